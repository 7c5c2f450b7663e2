"""Prompt data: reading files, chat templates, length filtering, the SFT layout and resumable batches."""

from __future__ import annotations

import copy
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from controller import data_files
from controller.data import (
    DataError,
    PromptDataset,
    PromptLoader,
    SFTDataset,
    build_dataset,
    needs_ground_truth,
    read_records,
    resolve_data_files,
)
from controller.rewards import BUILTIN_REWARDS, GROUND_TRUTH_REWARDS
from engines.models.tiny_models import build_tokenizer
from schema.job import DataSpec, JobSpec
from workers.environments import BUILTIN_ENVIRONMENTS, GROUND_TRUTH_ENVIRONMENTS

ROWS = [
    {"question": "1+1=", "answer": "2", "meta": {"level": 1}},
    {"question": "12+30=", "answer": "42", "meta": {"level": 2}},
    {"question": "7+8=", "answer": "15", "meta": None},
]
KEYS = dict(prompt_key="question", ground_truth_key="answer", extra_key="meta")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def chat_tokenizer():
    return build_tokenizer(chat_template=True)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_and_parquet_load_the_same(tmp_path, tokenizer):
    jsonl = write_jsonl(tmp_path / "d.jsonl", ROWS)
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    for path in (jsonl, parquet):
        batch = PromptDataset.from_file(path, tokenizer, **KEYS).head(3)
        assert list(batch.non_tensors["prompt"]) == ["1+1=", "12+30=", "7+8="]
        assert list(batch.non_tensors["ground_truth"]) == ["2", "42", "15"]
        assert batch.non_tensors["extra"][0] == {"level": 1} and batch.non_tensors["extra"][2] is None
        assert list(batch.non_tensors["uid"]) == ["0", "1", "2"]


def test_prompt_batch_is_left_padded(tmp_path, tokenizer):
    dataset = PromptDataset.from_file(write_jsonl(tmp_path / "d.jsonl", ROWS), tokenizer, **KEYS)
    batch = dataset.head(3)
    ids, mask = batch.tensors["input_ids"], batch.tensors["attention_mask"]
    assert ids.shape == (3, 6) and ids.dtype == torch.long
    assert mask.tolist() == [[0, 0, 1, 1, 1, 1], [1] * 6, [0, 0, 1, 1, 1, 1]]
    assert (ids[mask == 0] == tokenizer.pad_token_id).all()
    for row, prompt_ids in zip(ids, batch.non_tensors["prompt_ids"], strict=True):
        assert row[-len(prompt_ids) :].tolist() == prompt_ids
    assert tokenizer.decode(batch.non_tensors["prompt_ids"][1]) == "12+30="


def test_chat_messages_and_strings_use_the_chat_template(tmp_path, chat_tokenizer):
    rows = [
        {"prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1="}]},
        {"prompt": "2+2="},
    ]
    dataset = PromptDataset.from_file(write_jsonl(tmp_path / "chat.jsonl", rows), chat_tokenizer)
    assert (
        dataset[0].text
        == "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    )
    assert dataset[1].text == "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
    assert dataset[1].ids[0] == chat_tokenizer.convert_tokens_to_ids("<|im_start|>")  # one special token
    assert chat_tokenizer.decode(dataset[1].ids) == dataset[1].text


def test_messages_without_a_chat_template_are_an_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(
        DataError, match="line 1: the prompt is a list of chat messages but the tokenizer has no chat"
    ):
        PromptDataset.from_file(path, tokenizer)


def test_long_prompts_are_filtered_and_counted(tmp_path, tokenizer):
    rows = [{"prompt": "x" * n} for n in (3, 8, 9, 20, 5)]
    dataset = PromptDataset.from_file(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer, max_prompt_length=8)
    assert [len(r.ids) for r in dataset.rows] == [3, 8, 5]
    assert dataset.num_filtered == 2
    assert dataset.stats == {"rows": 5, "kept": 3, "filtered_prompt_too_long": 2}
    assert list(dataset.head(3).non_tensors["uid"]) == ["0", "1", "2"]  # uids stay dense
    with pytest.raises(DataError, match="all 5 rows were filtered out"):
        PromptDataset.from_file(tmp_path / "d.jsonl", tokenizer, max_prompt_length=2)


def test_clear_errors_for_bad_files(tmp_path, tokenizer):
    with pytest.raises(DataError, match="does not exist"):
        read_records(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("prompt\nhi\n")
    with pytest.raises(DataError, match="unknown extension '.csv'"):
        read_records(tmp_path / "d.csv")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": \n')
    with pytest.raises(DataError, match="bad.jsonl line 3: invalid JSON"):
        read_records(tmp_path / "bad.jsonl")
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": "b"}, {"question": "c"}])
    with pytest.raises(
        DataError, match=r"d.jsonl line 3: missing the prompt key 'prompt' \(keys: \['question'\]\)"
    ):
        PromptDataset.from_file(path, tokenizer)
    parquet = tmp_path / "d.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "a", "meta": "x"}, {"prompt": "b", "meta": "y"}]), parquet
    )
    with pytest.raises(DataError, match="d.parquet row 0: 'meta' must be an object"):
        PromptDataset.from_file(parquet, tokenizer, extra_key="meta")


def test_json_array_files(tmp_path, tokenizer):
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    assert len(PromptDataset.from_file(tmp_path / "d.json", tokenizer, **KEYS)) == 3


# ---- SFT layout -------------------------------------------------------------------------------


def test_sft_layout(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "sft.jsonl", ROWS)
    dataset = SFTDataset.from_file(path, tokenizer, response_key="answer", **KEYS)
    batch = dataset.make_batch([0, 1, 2])  # prompts of 4, 6, 4 tokens; responses "2", "42", "15" + EOS
    t = batch.tensors
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert t["responses"].shape == (3, 3) and t["input_ids"].shape == (3, 9)
    assert torch.equal(t["input_ids"][:, -3:], t["responses"])
    assert t["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1], [1, 1, 1]]
    assert t["attention_mask"].tolist() == [
        [0, 0, 1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1, 1, 1, 1],
        [0, 0, 1, 1, 1, 1, 1, 1, 1],
    ]
    assert t["responses"].tolist() == [tokenizer.encode("2") + [eos, pad], tokenizer.encode("42") + [eos]] + [
        tokenizer.encode("15") + [eos]
    ]
    for row, mask in zip(t["responses"], t["response_mask"], strict=True):
        assert row[mask.bool()][-1] == eos  # every response ends with EOS
    assert list(batch.non_tensors["response"]) == ["2", "42", "15"]


def test_sft_response_errors_and_filter(tmp_path, tokenizer):
    rows = [{"prompt": "a", "response": "short"}, {"prompt": "b", "response": "much too long"}]
    dataset = SFTDataset.from_file(
        write_jsonl(tmp_path / "sft.jsonl", rows), tokenizer, max_response_length=6
    )
    assert len(dataset) == 1 and dataset.stats["filtered_response_too_long"] == 1
    write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}])
    with pytest.raises(DataError, match="line 1: the response key 'response' is missing"):
        SFTDataset.from_file(tmp_path / "bad.jsonl", tokenizer)


# ---- resumable batching -----------------------------------------------------------------------


def make_dataset(tmp_path, tokenizer, n=23, sft=False):
    rows = [{"prompt": f"{i}+{i}=", "ground_truth": str(2 * i), "response": str(2 * i)} for i in range(n)]
    cls = SFTDataset if sft else PromptDataset
    return cls.from_file(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer)


def uids(batch):
    return list(batch.non_tensors["uid"])


@pytest.mark.parametrize("sft", [False, True])
@pytest.mark.parametrize("k", [0, 1, 4, 5, 7])  # 23 rows / 5 per batch: 4 batches per epoch
def test_resumed_loader_continues_exactly(tmp_path, tokenizer, sft, k):
    dataset = make_dataset(tmp_path, tokenizer, sft=sft)
    uninterrupted = PromptLoader(dataset, batch_size=5, seed=7)
    expected = [next(uninterrupted) for _ in range(k + 6)]

    first = PromptLoader(dataset, batch_size=5, seed=7)
    for _ in range(k):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # it survives a JSON round trip
    resumed = PromptLoader(dataset, batch_size=5, seed=123)  # the saved seed wins
    resumed.load_state_dict(state)
    for want in expected[k:]:
        got = next(resumed)
        assert uids(got) == uids(want)
        assert torch.equal(got.tensors["input_ids"], want.tensors["input_ids"])


def test_epochs_visit_each_row_once_in_new_orders(tmp_path, tokenizer):
    loader = PromptLoader(make_dataset(tmp_path, tokenizer, n=20), batch_size=5, seed=0)
    epochs = [[u for _ in range(4) for u in uids(next(loader))] for _ in range(3)]
    assert all(sorted(e, key=int) == [str(i) for i in range(20)] for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert loader.epoch == 2


def test_drop_last_and_unshuffled(tmp_path, tokenizer):
    dataset = make_dataset(tmp_path, tokenizer, n=7)
    keep = PromptLoader(dataset, batch_size=3, shuffle=False, drop_last=False)
    assert [uids(next(keep)) for _ in range(4)] == [["0", "1", "2"], ["3", "4", "5"], ["6"], ["0", "1", "2"]]
    drop = PromptLoader(dataset, batch_size=3, shuffle=False)
    assert [uids(next(drop)) for _ in range(3)] == [["0", "1", "2"], ["3", "4", "5"], ["0", "1", "2"]]
    with pytest.raises(DataError, match="at least as large"):
        PromptLoader(dataset, batch_size=8)
    other = PromptLoader(make_dataset(tmp_path, tokenizer, n=9), batch_size=3)
    with pytest.raises(DataError, match="saved state is for 7 rows"):
        other.load_state_dict(drop.state_dict())


# ---- from a job spec --------------------------------------------------------------------------


def test_builtin_task_goes_through_the_file_path(tmp_path, tokenizer):
    spec = DataSpec()  # the default: the built-in arithmetic task
    train, val = resolve_data_files(spec, tmp_path, seed=0)
    assert train.suffix == ".jsonl" and val is not None and val.exists()
    rl = build_dataset(train, tokenizer, spec)
    sft = build_dataset(train, tokenizer, spec, sft=True)
    assert isinstance(sft, SFTDataset) and len(rl) == len(sft) > 1000
    batch = next(PromptLoader(rl, batch_size=16, seed=0))
    assert batch.non_tensors["prompt"][0].endswith("=") and len(batch) == 16
    user = DataSpec(train_path=str(tmp_path / "mine.jsonl"))
    assert resolve_data_files(user, tmp_path) == (tmp_path / "mine.jsonl", None)


# ---- hostile files ----------------------------------------------------------------------------


def test_encodings_line_ends_and_nesting(tmp_path, tokenizer):
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\r\n\r\n{"prompt": "b\xe2\x80\xa8c\xc2\x85d"}\r\n')
    assert [(where, row["prompt"]) for where, row in read_records(bom)] == [
        ("line 1", "a"),
        ("line 3", "b\u2028c\x85d"),  # a JSON string may hold U+2028 and NEL raw: no line ends there
    ]
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match="latin1.jsonl line 2: not UTF-8 text"):
        read_records(tmp_path / "latin1.jsonl")
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    (tmp_path / "lies.jsonl").write_bytes(parquet.read_bytes())  # the suffix says JSON lines
    with pytest.raises(DataError, match="lies.jsonl line 1: "):
        read_records(tmp_path / "lies.jsonl")
    (tmp_path / "deep.jsonl").write_text('{"prompt": "a", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(DataError, match="deep.jsonl line 1: invalid JSON: nested too deeply"):
        read_records(tmp_path / "deep.jsonl")
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DataError, match="deep.json: invalid JSON: nested too deeply"):
        read_records(tmp_path / "deep.json")


def test_row_limit_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(data_files, "MAX_ROWS", 3)
    rows = [{"prompt": str(i)} for i in range(4)]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for path in (write_jsonl(tmp_path / "d.jsonl", rows), tmp_path / "d.json", tmp_path / "d.parquet"):
        with pytest.raises(DataError, match=f"{path.name}: more than 3 rows"):
            read_records(path)
    assert len(read_records(write_jsonl(tmp_path / "ok.jsonl", rows[:3]))) == 3


@pytest.mark.parametrize(
    "prompt, shown",
    [
        ([], "got []"),
        ([{"content": "hi"}], "got {'content': 'hi'}"),
        ([{"role": "user", "content": 5}], "got {'role': 'user', 'content': 5}"),
        ([{"role": "user", "content": None}], "'content': None}"),
        ([{"role": "user", "content": {"text": "hi"}}], "'content': {'text': 'hi'}}"),
    ],
)
def test_chat_messages_need_string_roles_and_contents(tmp_path, chat_tokenizer, prompt, shown):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "fine"}, {"prompt": prompt}])
    with pytest.raises(DataError, match=r"chat.jsonl line 2: 'prompt' must be .*" + re.escape(shown)):
        PromptDataset.from_file(path, chat_tokenizer)


def test_a_template_refusal_names_the_row(tmp_path, chat_tokenizer):
    strict = copy.deepcopy(chat_tokenizer)
    strict.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('users first') }}{% endif %}x"
    )
    rows = [{"prompt": "fine"}, {"prompt": [{"role": "assistant", "content": "hi"}]}]
    with pytest.raises(
        DataError, match="chat.jsonl line 2: the chat template refused the messages: users first"
    ):
        PromptDataset.from_file(write_jsonl(tmp_path / "chat.jsonl", rows), strict)


class RecordingTokenizer:
    """A tokenizer that notes the length of every text it is asked to encode."""

    def __init__(self, inner):
        self.inner, self.lengths = inner, []

    def __call__(self, texts, **options):
        self.lengths += [len(t) for t in ([texts] if isinstance(texts, str) else texts)]
        return self.inner(texts, **options)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_huge_prompt_or_response_is_dropped_untokenized(tmp_path, tokenizer):
    huge = "1+1 " * 250_000  # a million characters: no 8 tokens hold it
    rows = [
        {"prompt": "1+1=", "response": "2"},
        {"prompt": huge, "response": "2"},
        {"prompt": "2", "response": huge},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    recording = RecordingTokenizer(tokenizer)
    dataset = SFTDataset.from_file(path, recording, max_prompt_length=8, max_response_length=8)
    assert dataset.stats == {
        "rows": 3,
        "kept": 1,
        "filtered_prompt_too_long": 1,
        "filtered_response_too_long": 1,
    }
    assert max(recording.lengths) < 100


def test_a_parquet_that_expands_past_the_limit_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(data_files, "MAX_PARQUET_BYTES", 1_000_000)
    pq.write_table(pa.Table.from_pylist([{"prompt": "x" * 2_000_000}]), tmp_path / "bomb.parquet")
    assert (tmp_path / "bomb.parquet").stat().st_size < 100_000  # compressed to almost nothing
    with pytest.raises(
        DataError, match="bomb.parquet: 2,0[0-9,]+ bytes uncompressed; a job reads at most 1,000,000"
    ):
        read_records(tmp_path / "bomb.parquet")


# ---- rows a built-in reward cannot score ------------------------------------------------------


def test_a_row_without_ground_truth_is_refused_for_a_builtin_reward(tmp_path, tokenizer):
    rows = [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(10)]
    rows[6] = {"question": "6+1="}  # line 7: no answer
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    spec = JobSpec(data={"train_path": str(path), "prompt_key": "question", "ground_truth_key": "answer"})
    assert needs_ground_truth(spec)  # builtin:arithmetic, the default
    with pytest.raises(DataError, match=r"d.jsonl line 7: no ground truth 'answer' \(1 of 10 rows lack it\)"):
        build_dataset(path, tokenizer, spec.data, ground_truth=True)
    rows[2]["answer"] = None  # a null is no ground truth either; the first such row is named
    with pytest.raises(DataError, match=r"line 3: no ground truth 'answer' \(2 of 10 rows"):
        build_dataset(write_jsonl(path, rows), tokenizer, spec.data, ground_truth=True)
    rows[2]["answer"] = rows[6]["answer"] = "0"
    assert len(build_dataset(write_jsonl(path, rows), tokenizer, spec.data, ground_truth=True)) == 10


def test_the_rewards_and_environments_said_to_need_ground_truth_are_built_ins():
    assert {name.removeprefix("builtin:") for name in GROUND_TRUTH_REWARDS} <= set(BUILTIN_REWARDS)
    assert {name.removeprefix("builtin:") for name in GROUND_TRUTH_ENVIRONMENTS} <= set(BUILTIN_ENVIRONMENTS)


@pytest.mark.parametrize(
    "section, wanted",
    [
        ({"reward": {"function": "builtin:exact_match"}}, True),
        ({"reward": {"function": "builtin:numeric_match"}}, True),
        ({"reward": {"function": "builtin:format_boxed"}}, False),  # reads the response alone
        ({"reward": {"function": "tests.reward_fns:digit_reward"}}, False),  # user code decides
        ({"reward": {"function": None, "model_path": "/m"}}, False),
        ({"rollout": {"environment": "builtin:calculator"}}, True),  # the environment scores
        ({"rollout": {"environment": "tests.multiturn_envs:ScriptedEnv"}}, False),
        ({"method": "sft"}, False),
        ({"rollout": {"source": "external"}}, False),  # agents report the rewards
    ],
)
def test_which_jobs_need_a_ground_truth(section, wanted, tmp_path, tokenizer):
    spec = JobSpec(**section)
    assert needs_ground_truth(spec) is wanted
    if not wanted:  # such a job loads rows without one, as before
        path = write_jsonl(
            tmp_path / "d.jsonl", [{"prompt": "1+1="}, {"prompt": "2+2=", "ground_truth": None}]
        )
        assert len(build_dataset(path, tokenizer, spec.data, ground_truth=needs_ground_truth(spec))) == 2
