import math
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_train import data
from moe_train.config import TrainConfig
from moe_train.optim import build_optimizer, lr_at


def test_lr_schedule_hand_values() -> None:
    cfg = TrainConfig(steps=11, lr=1.0, min_lr=0.1, warmup_steps=2)
    assert [lr_at(s, cfg) for s in (0, 1)] == [0.5, 1.0]
    assert lr_at(2, cfg) == pytest.approx(1.0)  # cosine starts at the peak
    # halfway through the 8 decay steps (2..10), cos(pi/2) = 0: the midpoint of lr and min_lr
    assert lr_at(6, cfg) == pytest.approx(0.55)
    assert lr_at(10, cfg) == pytest.approx(0.1)
    expected = 0.1 + 0.45 * (1 + math.cos(math.pi * 3 / 8))
    assert lr_at(5, cfg) == pytest.approx(expected)


def test_weight_decay_only_on_matrices() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model, TrainConfig(weight_decay=0.3))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.3 for p in g["params"]}
    assert decayed == {id(model[0].weight)}
    assert sum(len(g["params"]) for g in opt.param_groups) == 4


def test_grouped_expert_biases_are_not_decayed() -> None:
    from moe_experts import GroupedExperts

    experts = GroupedExperts(4, 8, 6, backend="loop", bias=True, seed=0)  # biases stacked per expert: 2-D
    opt = build_optimizer(experts, TrainConfig(weight_decay=0.3))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.3 for p in g["params"]}
    assert decayed == {id(experts.w_gate_up_EH2F), id(experts.w_down_EFH)}


def test_token_file_is_the_concatenated_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sources = []
    for name, text in (("a.py", b"import os\n"), ("b.py", b"x = 1\n")):
        (tmp_path / name).write_bytes(text)
        sources.append(tmp_path / name)
    monkeypatch.setattr(data, "stdlib_sources", lambda: sources)
    path = data.stdlib_token_file(tmp_path / "cache")
    assert path.read_bytes() == b"import os\n" + data.SEPARATOR + b"x = 1\n" + data.SEPARATOR
    assert not list((tmp_path / "cache").glob("*.tmp*"))  # written aside, then renamed
    assert data.stdlib_token_file(tmp_path / "cache") == path  # cached


def test_batches_are_deterministic_shifted_and_split_by_rank(tmp_path: Path) -> None:
    path = tmp_path / "tokens.u8"
    path.write_bytes(bytes(range(256)) * 8)
    stream = data.TokenStream(path, seq_len=16, seed=3)
    whole = stream.batch(step=5, global_batch=8, start=0, count=8)
    assert torch.equal(whole.labels_BS[:, :-1], whole.input_ids_BS[:, 1:])
    # bytes(range(256)) repeated: the next token is always (token + 1) % 256
    assert torch.equal(whole.labels_BS, (whole.input_ids_BS + 1) % 256)
    halves = [stream.batch(5, 8, start, 4) for start in (0, 4)]
    assert torch.equal(torch.cat([h.input_ids_BS for h in halves]), whole.input_ids_BS)
    again = data.TokenStream(path, seq_len=16, seed=3).batch(5, 8, 0, 8)
    assert torch.equal(again.input_ids_BS, whole.input_ids_BS)
    other_step = stream.batch(6, 8, 0, 8)
    assert not torch.equal(other_step.input_ids_BS, whole.input_ids_BS)
    offsets = stream.global_offsets(5, 8)
    assert np.all(offsets + 17 <= len(stream.tokens))


def test_sequence_longer_than_data_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "tokens.u8"
    path.write_bytes(b"abc")
    with pytest.raises(ValueError, match="data.seq_len=16"):
        data.TokenStream(path, seq_len=16, seed=0)


def test_warmup_longer_than_the_run_is_clamped() -> None:
    cfg = TrainConfig(steps=4, lr=1.0, min_lr=0.0, warmup_steps=10)
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
