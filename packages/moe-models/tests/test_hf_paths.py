"""A checkpoint's files must lie inside its directory: index entries that lead out of it (``../``, absolute paths,
symlinks) are refused before anything is opened; a HuggingFace hub cache snapshot's links into ``../../blobs`` load."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from _hf_reference import tiny_model
from safetensors.torch import save_file

from moe_models.hf import HFCheckpointError, load_pretrained, save_pretrained
from moe_models.hf import files as hf_files
from moe_models.hf.files import CheckpointReader, containment_root, resolve_inside

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_moe")


@pytest.fixture
def sharded(model, tmp_path: Path) -> Path:
    save_pretrained(model, tmp_path / "ckpt", max_shard_size="40KB")
    return tmp_path / "ckpt"


def _weight_map(ckpt: Path) -> dict[str, str]:
    return json.loads((ckpt / INDEX).read_text())["weight_map"]


def _rewrite_index(ckpt: Path, weight_map: dict[str, str]) -> None:
    index = json.loads((ckpt / INDEX).read_text())
    index["weight_map"] = weight_map
    (ckpt / INDEX).write_text(json.dumps(index))


def _never_opened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    opened: list[str] = []
    real = hf_files.safe_open
    monkeypatch.setattr(hf_files, "safe_open", lambda path, **kw: opened.append(str(path)) or real(path, **kw))
    return opened


def _move_out(ckpt: Path, shard: str) -> Path:
    """Moves ``shard`` next to the checkpoint, into ``outside/``, where the old code read it from."""
    outside = ckpt.parent / "outside"
    outside.mkdir(exist_ok=True)
    shutil.move(ckpt / shard, outside / shard)
    return outside / shard


def test_an_index_entry_leading_up_and_out_is_refused_naming_it(sharded: Path, monkeypatch) -> None:
    weight_map = _weight_map(sharded)
    shard = weight_map["model.embed_tokens.weight"]
    _move_out(sharded, shard)  # a real safetensors file: the old code loaded it and trained on it
    moved = {k: (f"../outside/{f}" if f == shard else f) for k, f in weight_map.items()}
    _rewrite_index(sharded, moved)
    first = min(k for k, f in moved.items() if f == f"../outside/{shard}")
    opened = _never_opened(monkeypatch)
    with pytest.raises(HFCheckpointError) as info:
        load_pretrained(sharded)
    message = str(info.value)
    assert "\n" not in message
    assert f"weight_map entry {first!r}: '../outside/{shard}'" in message
    assert "the index points outside the checkpoint directory" in message
    assert opened == []  # refused before any shard is opened


@pytest.mark.parametrize("entry", ["absolute", "../../../../../../../../etc/passwd"])
def test_absolute_and_far_up_index_entries_are_refused(sharded: Path, entry: str, monkeypatch) -> None:
    weight_map = _weight_map(sharded)
    shard = weight_map["lm_head.weight"]
    target = str(_move_out(sharded, shard)) if entry == "absolute" else entry
    _rewrite_index(sharded, {k: (target if f == shard else f) for k, f in weight_map.items()})
    opened = _never_opened(monkeypatch)
    with pytest.raises(HFCheckpointError, match="the index points outside the checkpoint directory") as info:
        CheckpointReader(sharded)
    assert repr(target) in str(info.value) and opened == []


def test_a_symlinked_shard_leading_outside_is_refused(sharded: Path) -> None:
    shard = _weight_map(sharded)["lm_head.weight"]
    outside = _move_out(sharded, shard)
    (sharded / shard).symlink_to(outside)  # the index names a file inside; the file is a link out
    with pytest.raises(HFCheckpointError, match=f"weight_map entry .*: '{shard}'.*points outside"):
        load_pretrained(sharded)


def test_a_symlinked_single_file_leading_outside_is_refused(model, tmp_path: Path) -> None:
    save_pretrained(model, tmp_path / "ckpt")
    (tmp_path / "elsewhere").mkdir()
    shutil.move(tmp_path / "ckpt" / "model.safetensors", tmp_path / "elsewhere" / "model.safetensors")
    (tmp_path / "ckpt" / "model.safetensors").symlink_to(tmp_path / "elsewhere" / "model.safetensors")
    with pytest.raises(HFCheckpointError, match=r"model\.safetensors resolves to .*elsewhere.*outside the checkpoint"):
        load_pretrained(tmp_path / "ckpt")


def test_links_and_dot_dots_that_stay_inside_load(model, sharded: Path) -> None:
    weight_map = _weight_map(sharded)
    shard = weight_map["lm_head.weight"]
    (sharded / "sub").mkdir()
    shutil.move(sharded / shard, sharded / "sub" / shard)
    (sharded / "link.safetensors").symlink_to(Path("sub") / shard)
    names = {shard: "sub/../link.safetensors"}
    _rewrite_index(sharded, {k: names.get(f, f) for k, f in weight_map.items()})
    back = load_pretrained(sharded)
    assert torch.equal(back.lm_head.weight, model.lm_head.weight)


def _hub_cache(ckpt: Path, root: Path) -> Path:
    """``ckpt`` laid out as the HuggingFace hub cache does: every file a blob, the snapshot's files links to them."""
    repo = root / "models--a--b"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(ckpt.iterdir())):
        shutil.copy(file, repo / "blobs" / f"blob{i:04d}")
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i:04d}")
    return snapshot


@pytest.mark.parametrize("shards", [False, True])
def test_a_hub_cache_snapshot_still_loads(model, tmp_path: Path, shards: bool) -> None:
    save_pretrained(model, tmp_path / "ckpt", max_shard_size="40KB" if shards else "5GB")
    assert (tmp_path / "ckpt" / INDEX).exists() == shards
    snapshot = _hub_cache(tmp_path / "ckpt", tmp_path / "hub")
    assert os.readlink(snapshot / "config.json").startswith("../../blobs/")
    assert containment_root(snapshot) == (tmp_path / "hub" / "models--a--b").resolve()
    back = load_pretrained(snapshot)
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_a_hub_cache_snapshot_is_still_contained(tmp_path: Path) -> None:
    repo = tmp_path / "models--a--b"
    snapshot = repo / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(tmp_path / "stray.safetensors"))
    (snapshot / INDEX).write_text(json.dumps({"weight_map": {"w": "../../../stray.safetensors"}}))
    with pytest.raises(HFCheckpointError, match=f"'w': '../../../stray.safetensors'.*{repo.name}"):
        CheckpointReader(snapshot)


def test_resolve_inside(tmp_path: Path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "x").write_text("")
    (tmp_path / "d" / "out").symlink_to(tmp_path / "x")
    (tmp_path / "d" / "in").symlink_to("sub")
    d = tmp_path / "d"
    assert resolve_inside(d, "sub/../a.safetensors") == d.resolve() / "a.safetensors"  # need not exist
    assert resolve_inside(d, "in/f") == d.resolve() / "sub" / "f"
    for outside in ("../x", "out", str(tmp_path / "x"), "/etc/passwd", "sub/../../x"):
        assert resolve_inside(d, outside) is None, outside
    (d / "loop").symlink_to("loop")
    assert resolve_inside(d, "loop") is None


def test_a_config_json_linked_from_outside_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").symlink_to(outside)
    with pytest.raises(HFCheckpointError, match="config.json resolves to .*outside the checkpoint directory"):
        load_pretrained(model_dir)
