"""Every malformed chat or prompt/completion input is a one-line ConfigError naming the source file, the record, the
field and the fix (through the CLI: exit code 2, the error as the last line of stderr, nothing written); with
data.bad_records=skip / data.truncation=skip the records are left out and counted by reason, never silently."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from moe_train import cli
from moe_train.config import ConfigError, load_config

sys.path.insert(0, str(Path(__file__).parent))  # the tests run in importlib mode: the shared helpers' directory
from test_conversations import CONVERSATIONS, SEQ_LEN, prepare, write_jsonl, write_tokenizer

GOOD = {"messages": CONVERSATIONS[1]}
USER = {"role": "user", "content": "hi"}
ANSWER = {"role": "assistant", "content": "hello"}
# (bad record, skip reason, what the error says about it)
BAD = {
    "unknown role": (
        {"messages": [{"role": "robot", "content": "x"}, ANSWER]},
        "with an unknown role",
        "messages[0].role='robot' is not a role (system, user, assistant, tool)",
    ),
    "unknown speaker": (
        {"conversations": [{"from": "bot", "value": "x"}]},
        "with an unknown role",
        "conversations[0].from='bot' is not a speaker",
    ),
    "empty": ({"messages": []}, "with an empty conversation", "field 'messages' is an empty conversation"),
    "missing field": (
        {"text": "x"},
        "missing a field",
        "no field 'messages' or 'conversations' (fields: text); set data.messages_field",
    ),
    "missing content": ({"messages": [{"role": "user"}, ANSWER]}, "missing a field", "messages[0].content is missing"),
    "content type": (
        {"messages": [{"role": "user", "content": 5}, ANSWER]},
        "with a field of the wrong type",
        "messages[0].content holds int, not a string",
    ),
    "turns type": ({"messages": "hi"}, "with a field of the wrong type", "field 'messages' holds str, not a list"),
    "no assistant": (
        {"messages": [USER]},
        "without an assistant turn",
        "has no assistant turn, so "
        "data.loss_on=assistant labels nothing in it; drop the record or set --data.loss_on all",
    ),
    "not an object": ([1, 2], "not a JSON object", "is a JSON list, not an object"),
    "not JSON": ("{oops", "not a JSON object", "is not JSON"),
    "surrogate": (
        '{"messages": [{"role": "user", "content": "a\\udc80"}, {"role": "assistant", "content": "b"}]}',
        "with an unpaired surrogate",
        "messages[0].content holds an unpaired surrogate",
    ),
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _one_line(err: pytest.ExceptionInfo[ConfigError]) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_record_names_file_line_field_and_fix(case: str, tokenizer_dir: Path, tmp_path: Path) -> None:
    record, _, what = BAD[case]
    source = write_jsonl(tmp_path / "chat.jsonl", [GOOD, GOOD, record, GOOD])
    with pytest.raises(ConfigError) as err:
        prepare(source, tokenizer_dir, tmp_path / "cache")
    message = _one_line(err)
    assert message.startswith(f"data.source='{source}': chat.jsonl line 3: ")
    assert what in message and "--data.bad_records skip" in message
    assert not list((tmp_path / "cache").glob("chat-*"))  # nothing cached


def test_skipped_records_are_counted_by_reason(tokenizer_dir: Path, tmp_path: Path) -> None:
    records = [GOOD] + [BAD[case][0] for case in BAD] + [GOOD]
    source = write_jsonl(tmp_path / "chat.jsonl", records)
    prepared = prepare(source, tokenizer_dir, tmp_path / "cache", **{"data.bad_records": "skip"})
    want: dict[str, int] = {}
    for _, reason, _ in BAD.values():
        want[reason] = want.get(reason, 0) + 1
    assert prepared.skipped == want
    assert len(prepared.train) == 2  # the good ones, a window each
    # the entry built with skip serves a later run, which with data.bad_records=error still refuses the first
    with pytest.raises(ConfigError) as err:
        prepare(source, tokenizer_dir, tmp_path / "cache")
    assert "chat.jsonl line 2: messages[0].role='robot'" in _one_line(err)


def test_loss_on_all_takes_a_conversation_without_assistant(tokenizer_dir: Path, tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "chat.jsonl", [GOOD, {"messages": [USER]}])
    prepared = prepare(source, tokenizer_dir, tmp_path / "cache", **{"data.loss_on": "all"})
    assert len(prepared.train) == 2 and prepared.skipped == {}


def test_prompt_completion_missing_fields(tokenizer_dir: Path, tmp_path: Path) -> None:
    extra = {"data.format": "prompt_completion"}
    source = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "a"}])
    with pytest.raises(ConfigError) as err:
        prepare(source, tokenizer_dir, tmp_path / "c", **extra)
    assert "pc.jsonl line 2: field 'completion' is missing; give every record one, or set data.completion_field" in (
        _one_line(err)
    )
    parquet = tmp_path / "pc.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "b"}]), parquet)
    with pytest.raises(ConfigError) as err:
        prepare(parquet, tokenizer_dir, tmp_path / "c", **extra)
    assert "data.prompt_field='prompt' / data.completion_field='completion': pc.parquet lacks one of them " in (
        _one_line(err)
    )


def test_a_conversation_longer_than_a_window(tokenizer_dir: Path, tmp_path: Path) -> None:
    long = {"messages": [USER, {"role": "assistant", "content": "the answer is 42. " * 40}]}
    source = write_jsonl(tmp_path / "chat.jsonl", [GOOD, long, GOOD, long])
    with pytest.raises(ConfigError) as err:
        prepare(source, tokenizer_dir, tmp_path / "cache")
    message = _one_line(err)
    assert "chat.jsonl line 2: the conversation is " in message
    assert f"longer than data.seq_len={SEQ_LEN}" in message and "--data.truncation skip" in message
    prepared = prepare(source, tokenizer_dir, tmp_path / "cache", **{"data.truncation": "skip"})
    assert prepared.skipped == {"longer than data.seq_len": 2} and len(prepared.train) == 2


def test_nothing_usable_is_an_error(tokenizer_dir: Path, tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": []}])
    with pytest.raises(ConfigError) as err:
        prepare(source, tokenizer_dir, tmp_path / "cache", **{"data.bad_records": "skip"})
    assert "no usable conversation (data.bad_records=skip skipped 1 with an empty conversation)" in _one_line(err)


def test_template_errors_name_data_chat_template(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "chat.jsonl", [GOOD])
    with pytest.raises(ConfigError) as err:
        prepare(source, write_tokenizer(tmp_path / "none", None), tmp_path / "c")
    assert "data.chat_template='': data.tokenizer=" in _one_line(err)
    assert "has no chat template" in str(err.value) and "name a jinja template file with data.chat_template" in (
        str(err.value)
    )
    named = write_tokenizer(tmp_path / "named", [{"name": "tool_use", "template": "x"}])
    with pytest.raises(ConfigError, match="none of them 'default'"):
        prepare(source, named, tmp_path / "c")
    broken = write_tokenizer(tmp_path / "broken", "{% for m in messages %}")
    with pytest.raises(ConfigError, match=r"the template of data.tokenizer=.*not a jinja template"):
        prepare(source, broken, tmp_path / "c")
    with pytest.raises(ConfigError, match="data.chat_template='/no/such.jinja': cannot read it"):
        prepare(source, write_tokenizer(tmp_path / "t"), tmp_path / "c", **{"data.chat_template": "/no/such.jinja"})


def test_a_template_refusing_a_record_is_a_bad_record(tmp_path: Path) -> None:
    strict = "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}" + (
        "{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    )
    source = write_jsonl(tmp_path / "chat.jsonl", [GOOD, {"messages": CONVERSATIONS[2]}])
    tokenizer = write_tokenizer(tmp_path / "strict", strict)
    with pytest.raises(ConfigError) as err:
        prepare(source, tokenizer, tmp_path / "c")
    assert "chat.jsonl line 2: the chat template refused the conversation: " in _one_line(err)
    prepared = prepare(source, tokenizer, tmp_path / "c", **{"data.bad_records": "skip"})
    assert prepared.skipped == {"refused by the chat template": 1}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"data.format": "sharegpt"}, "data.format='sharegpt': choose text"),
        ({"data.loss_on": "completion"}, "data.loss_on='completion': does not apply to data.format=chat"),
        ({"data.loss_on": "answers"}, "data.loss_on='answers': is not a choice"),
        ({"data.truncation": "cut"}, "data.truncation='cut': choose error"),
        ({"data.bad_records": "drop"}, "data.bad_records='drop': choose error"),
        ({"data.source": "stdlib"}, "data.source='stdlib' is text, not chat records"),
        ({"data.format": "prompt_completion", "data.prompt_field": ""}, "data.prompt_field='': name the record"),
        ({"data.format": "prompt_completion", "data.completion_field": "prompt"}, "are both 'prompt'"),
        ({"data.format": "text", "data.loss_on": "assistant"}, "does not apply to data.format=text"),
        ({"model.mtp_num_layers": "1"}, "model.mtp_num_layers=1: multi-token prediction is not supported on packed"),
        (
            {"model.preset": "tiny-qwen3-next", "parallel.cp": "2"},
            "parallel.cp=2: the model's recurrent layers (model.experimental_attention_variant=gated_delta_net) "
            "take packed conversations at cp=1 only yet; set --data.packing false or --parallel.cp 1",
        ),
        (
            {"model.preset": "tiny-nemotron-h", "parallel.cp": "2"},
            "parallel.cp=2: the model's recurrent layers (model.hybrid_override_pattern=ME*EM-) take packed",
        ),
    ],
)
def test_config_checks_that_read_no_files(overrides: dict[str, str], expected: str) -> None:
    base = {"data.format": "chat", "data.source": "chat.jsonl", "data.tokenizer": "/t/tokenizer.json"}
    with pytest.raises(ConfigError) as err:
        load_config("tiny", {**base, **overrides})
    assert expected in _one_line(err)


@pytest.mark.parametrize("tokenizer", ["", "bytes"])
def test_conversations_need_a_tokenizer(tokenizer: str, tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "chat.jsonl", [GOOD])
    with pytest.raises(ConfigError) as err:
        prepare(source, Path("unused"), tmp_path / "cache", **{"data.tokenizer": tokenizer})
    assert f"data.tokenizer={tokenizer!r}: data.format=chat needs a tokenizer" in _one_line(err)


def test_a_text_source_is_not_records(tokenizer_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("some text")
    with pytest.raises(ConfigError, match="a.txt is text, not records"):
        prepare(tmp_path / "a.txt", tokenizer_dir, tmp_path / "c")


def test_cli_bad_record_is_one_line_exit_2(tokenizer_dir: Path, tmp_path: Path, capsys) -> None:
    source = write_jsonl(tmp_path / "chat.jsonl", [GOOD, BAD["unknown role"][0]])
    args = {
        "data.format": "chat",
        "data.source": str(source),
        "data.tokenizer": str(tokenizer_dir),
        "data.cache_dir": str(tmp_path / "cache"),
        "data.seq_len": "64",
        "model.vocab_size": "320",
        "model.num_layers": "1",
        "train.steps": "1",
        "run.output_dir": str(tmp_path / "run"),
    }
    assert cli.main(["train", "--config", "tiny", *[t for k, v in args.items() for t in (f"--{k}", v)]]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]  # after "tokenising ..."
    assert last.startswith("moe-train: error: data.source=") and "chat.jsonl line 2: messages[0].role='robot'" in last
    assert not (tmp_path / "run").exists()
    json.dumps(last)  # one plain line
