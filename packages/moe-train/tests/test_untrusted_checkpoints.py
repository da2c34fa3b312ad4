"""Checkpoints from elsewhere: a ``.metadata`` whose pickle runs a command is refused by export, quantize and resume
without running it (its command would create a marker file); a truncated checkpoint names the file that is short."""

from __future__ import annotations

import json
import operator
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from moe_train import cli

SMALL = ["--model.num_layers", "1", "--data.seq_len", "16", "--train.global_batch_size", "4"]


class _Command:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class _RunsThenReturns:
    """Unpickles as ``(os.system(command), metadata)[1]``: the command runs, the real metadata comes back, so a reader
    that unpickles sees a valid checkpoint (the issue's export exited 0 with a correct-looking result)."""

    def __init__(self, command: str, metadata: object) -> None:
        self.command, self.metadata = command, metadata

    def __reduce__(self):
        return (operator.getitem, ((_Command(self.command), self.metadata), 1))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> Path:
    out = tmp_path_factory.mktemp("trusted") / "run"
    args = ["train", *SMALL, "--train.steps", "2", "--run.output_dir", str(out), "--data.cache_dir", str(data_cache)]
    assert cli.main(args) == 0
    return out


def _tampered(run: Path, where: Path, marker: Path) -> Path:
    checkpoint = where / "step_2"
    shutil.copytree(run / "checkpoints" / "step_2", checkpoint)
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    payload = _RunsThenReturns(f"touch {marker}", metadata)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(payload))
    return checkpoint


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_malicious_metadata_runs_nothing(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "ran"
    checkpoint = _tampered(run, tmp_path, marker)
    refused = f"{checkpoint}/.metadata: refused to unpickle '_operator.getitem' (not a DCP metadata type)"
    resume = ["--run.resume", str(checkpoint)]
    commands = {
        "export": ["export", str(checkpoint), "--hf", str(tmp_path / "hf")],
        "quantize": ["quantize", str(checkpoint), "--recipe", "fp8", "--out", str(tmp_path / "fp8")],
        "resume": ["train", *SMALL, "--train.steps", "4", "--run.output_dir", str(tmp_path / "resumed"), *resume],
    }
    for name, args in commands.items():
        capsys.readouterr()
        assert cli.main(args) == 2, name
        assert refused in _one_line(capsys), name
        assert not marker.exists(), f"{name} ran the checkpoint's command"
    assert not any((tmp_path / name).exists() for name in ("hf", "fp8", "resumed"))
    # what the test guards against is real: DCP's own reader runs the command and reads a valid checkpoint
    assert dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    assert marker.exists()


def test_a_truncated_checkpoint_names_the_short_file(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The old message: ``cannot be read (EOFError: )``."""
    checkpoint = tmp_path / "step_2"
    shutil.copytree(run / "checkpoints" / "step_2", checkpoint)
    data = checkpoint / "__0_0.distcp"
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size // 2)
    assert cli.main(["export", str(checkpoint), "--hf", str(tmp_path / "hf")]) == 2
    line = _one_line(capsys)
    assert f"{data}: {size // 2} bytes, its metadata reads up to byte" in line
    assert "(truncated): the checkpoint is damaged: resume from an earlier one or copy it again" in line


def test_exported_files_have_the_modes_of_every_other_file(run: Path, tmp_path: Path) -> None:
    """safetensors writes its files 0600; the export's now follow the umask, as config.json always did."""
    mask = os.umask(0o022)
    try:
        assert cli.main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 0
    finally:
        os.umask(mask)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "hf").iterdir()}
    assert modes == {"config.json": "0o644", "model.safetensors": "0o644"}


def test_a_checkpoint_naming_a_secret_as_its_tokenizer_does_not_export_it(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """meta.json comes with the checkpoint: a ``data.tokenizer`` naming a private file (an SSH key, credentials)
    used to be copied into the export as tokenizer.json."""
    secret = tmp_path / "id_ed25519"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    checkpoint = tmp_path / "step_2"
    shutil.copytree(run / "checkpoints" / "step_2", checkpoint)
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["config"]["data"]["tokenizer"] = str(secret)
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    assert cli.main(["export", str(checkpoint), "--hf", str(tmp_path / "hf")]) == 0
    assert "is not a tokenizer file inside its directory; the export has no tokenizer" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
