"""``mlx-recovery bench server``: the three arms on the real oMLX server, driven by the
OpenAI SDK over loopback.

Modules, one idea each: ``models`` (the models directory and SpecPrefill settings),
``process`` (one server subprocess: start, readiness, attachment, stop), ``client``
(one streamed turn through the OpenAI SDK), ``sessions`` (the conversations sent),
``run`` (arms and sessions), ``report`` (records, table, JSON, plot), ``cli``.
"""
