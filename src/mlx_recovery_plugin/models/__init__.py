"""Trained models fetched from a package index and converted once into the model cache."""
