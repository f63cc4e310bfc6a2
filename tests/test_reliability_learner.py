"""Nothing silently wrong on the learner side: flags checked as they are used, data files
checked line by line when loaded, non-finite values stop train.grpo before anything is written from
them, and checkpoints that prove themselves (real orbax files with real flipped or truncated bytes)
resume bit-identically or not at all."""

import ast
import dataclasses
import inspect
import json
import logging
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tyro

from rlkjax.core.checks import MIN_TEMPERATURE
from rlkjax.entry_config import flat_defaults
from rlkjax.rl.tasks import GSM8KTask, make_task
from train import grpo, guards, metrics
from train.checkpoints import CheckpointError, Checkpoints, check_disk
from train.config import Optimiser

SMALL = dict(prompts_per_step=2, group_size=4, max_new_tokens=4, max_prompt_tokens=16, progress=False)


# ----- 1. flags -----
@pytest.mark.parametrize(
    "name,value",
    [
        ("weight_decay", float("nan")),
        ("weight_decay", float("inf")),
        ("max_grad_norm", float("nan")),
        ("max_grad_norm", float("inf")),
        ("beta", float("nan")),
        ("beta", float("inf")),
        ("tis_cap", float("nan")),
        ("clip_eps", float("nan")),
        ("learning_rate", 1e39),  # finite as a float64, inf as the float32 it is used as
        ("warmup_steps", -1),
        ("temperature", 1e-46),
        ("temperature", 0.0),  # greedy: every sample of a group the same, zero advantage
        ("temperature", float("nan")),
        ("seed", -1),
        ("seed", 2**32),
    ],
)
def test_flags_are_checked_as_they_are_used(name, value):
    """NaN passes every comparison (`nan < 0` is False), so `--beta nan` trained today; 1e-46 passes a
    float64 `> 0` check and becomes 0 in float32 (NaN logprobs). Each error names the flag and the value."""
    with pytest.raises(ValueError) as error:
        if name in flat_defaults(Optimiser):
            Optimiser(**{name: value})
        else:
            grpo.GRPOConfig(**{name: value})
    message = str(error.value)
    assert f"--{name.replace('_', '-')}" in message and repr(value) in message, message


def test_data_for_a_task_that_ignores_it_is_refused():
    with pytest.raises(ValueError, match="--data 'gsm8k.jsonl' is read only by --task gsm8k"):
        grpo.GRPOConfig(data="gsm8k.jsonl")


def test_help_names_the_smallest_temperature(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit):
        tyro.cli(grpo.GRPOConfig, args=["--help"])
    assert f"at least {MIN_TEMPERATURE}" in capsys.readouterr().out


def field_docs(config_type) -> dict[str, str]:
    """{field: the docstring under it} of a dataclass, read from its source as tyro reads it."""
    body = ast.parse(inspect.getsource(config_type)).body[0].body
    return {
        field.target.id: " ".join(doc.value.value.split())
        for field, doc in zip(body, body[1:])
        if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
    }


def test_help_documents_every_flag(capsys, monkeypatch):
    """Every GRPOConfig field is a flag in --help, shown with the docstring under it (tyro reads it from the
    source), and so is every field of the configs it nests (ModelSource, Optimiser, Runtime: their flags keep
    plain names): a field moved, added or renamed without its docstring would show up undocumented."""
    docs = field_docs(grpo.GRPOConfig)
    assert set(docs) == {f.name for f in dataclasses.fields(grpo.GRPOConfig)}
    nested = [f for f in dataclasses.fields(grpo.GRPOConfig) if dataclasses.is_dataclass(f.default)]
    flags = {name: doc for name, doc in docs.items() if name not in {f.name for f in nested}}
    for f in nested:
        flags |= field_docs(type(f.default))
    assert set(flags) == set(flat_defaults(grpo.GRPOConfig))
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit):
        tyro.cli(grpo.GRPOConfig, args=["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name, doc in flags.items():
        assert f"--{name.replace('_', '-')}" in text, name
        assert " ".join(doc.split()[:4]) in text, (name, doc)


# ----- 8. data files -----
def gsm8k(question="1+1?", answer="so #### 2"):
    return json.dumps({"question": question, "answer": answer})


@pytest.mark.parametrize(
    "lines,error",
    [
        (["", gsm8k(), "", "{not json"], ":4: not valid JSON"),  # blank lines counted: the bad line is line 4, not 2
        ([gsm8k(), gsm8k(question=5)], ":2: 'question' must be a string, got int"),
        ([gsm8k(answer=["#### 2"])], ":1: 'answer' must be a string, got list"),
        ([json.dumps({"question": "q"})], ":1: 'answer' must be a string, got nothing"),
        (
            [gsm8k(), gsm8k(answer="no final answer")],
            ":2: need a non-empty 'question' and an 'answer' ending in '#### <number>'",
        ),
        ([gsm8k(), gsm8k(answer="#### ")], ":2: need"),
        (["[1, 2]"], ":1: expected a JSON object, got list"),
        (["", ""], ": no examples"),
    ],
)
def test_data_file_errors_name_the_file_and_line(tmp_path, lines, error):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as e:
        GSM8KTask(path)
    assert str(e.value).startswith(f"{path}{error}") and "\n" not in str(e.value), str(e.value)


def test_binary_and_unicode_data_files(tmp_path):
    """A binary file is one line naming the file (not a UnicodeDecodeError); U+2028 inside a JSON string
    is valid JSONL and must not split the line (str.splitlines would) or shift later line numbers."""
    binary = tmp_path / "model.safetensors"
    binary.write_bytes(b"{}\n\x89PNG\r\n\x1a\n\x00\xff")
    with pytest.raises(ValueError, match=r"model.safetensors:2: not UTF-8 text \(byte 0x89 at offset 3\)"):
        GSM8KTask(binary)
    text = tmp_path / "unicode.jsonl"
    text.write_text(json.dumps({"question": "a\u2028b\x85c", "answer": "#### -3"}, ensure_ascii=False) + "\noops\n")
    with pytest.raises(ValueError, match="unicode.jsonl:2: not valid JSON"):
        GSM8KTask(text)
    text.write_text("\ufeff" + json.dumps({"question": "a\u2028b", "answer": "#### -3"}, ensure_ascii=False) + "\n")
    assert GSM8KTask(text).examples[0].prompt == "a\u2028b" and GSM8KTask(text).examples[0].answer == "-3"


def test_overlong_prompt_is_found_when_the_file_is_loaded(tmp_path):
    """A prompt longer than --max-prompt-tokens stops train.grpo at start, naming file and line (today:
    whenever it happens to be sampled, maybe hours in)."""
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join([gsm8k(), "", gsm8k(question="x" * 17), gsm8k()]) + "\n")
    with pytest.raises(ValueError, match=rf"^{path}:3: the first prompt is 17 tokens; --max-prompt-tokens=16 accepts"):
        grpo.train(grpo.GRPOConfig(task="gsm8k", data=str(path), out=str(tmp_path / "run"), **SMALL))
    assert not (tmp_path / "run" / "checkpoints").exists()


# ----- 1. non-finite values stop the run -----
def test_nonfinite_parameters_stop_the_run_before_anything_is_written(tmp_path):
    """Warmup makes step 1's learning rate 0 (a good checkpoint 1); at step 2 lr * weight decay * w
    = 1e30 * 1e30 * w overflows float32, so the updated parameters are inf. The run stops naming step
    and tensor; checkpoint 1 is kept (not rotated out by --keep-checkpoints 1), no checkpoint 2, no
    final_hf, no metrics row for step 2."""
    config = grpo.GRPOConfig(
        steps=3,
        optimiser=Optimiser(warmup_steps=1, learning_rate=1e30, weight_decay=1e30),
        checkpoint_every=1,
        keep_checkpoints=1,
        verify_every=0,
        out=str(tmp_path),
        **SMALL,
    )
    with pytest.raises(guards.NonFiniteError) as error:
        grpo.train(config)
    message = str(error.value)
    assert message.startswith("step 2: parameter ['embed_tokens'] holds non-finite values"), message
    assert f"last good checkpoint is step 1 in {tmp_path.absolute() / 'checkpoints'}" in message, message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1"]
    assert not (tmp_path / "final_hf").exists()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]


def nan_reward(prompt: str, completion: str) -> float:
    """A user reward (--reward) that fails quietly."""
    return float("nan") if len(completion) > 0 else 0.0


def test_nonfinite_user_reward_stops_the_run(tmp_path):
    """A NaN reward would make every advantage of its group NaN (and the loss); it is named at its source."""
    with pytest.raises(guards.NonFiniteError, match=r"^step 1: the reward of prompt 0, sample 0 is nan \('"):
        grpo.train(
            grpo.GRPOConfig(
                steps=1,
                reward="tests.test_reliability_learner:nan_reward",
                verify_every=0,
                out=str(tmp_path),
                **SMALL,
            )
        )
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
    for spec, error in (
        ("tests.nowhere:f", "No module named 'tests.nowhere'"),
        ("tests.test_reliability_learner:SMALL", "not a function"),
        ("tests.test_reliability_learner:nope", "has no attribute 'nope'"),
    ):
        with pytest.raises(ValueError, match=f"reward '{spec}'.*{error}"):
            make_task("lowercase", None, spec)


def test_nonfinite_names_what_came_first():
    grads = {"a": np.ones(2), "b": np.array([1.0, np.nan])}
    finite = {"gradient": np.array([True, False]), "parameter": np.array([False, False])}
    trees = {"gradient": grads, "parameter": grads}
    assert guards.nonfinite(7, float("inf"), 1.0, finite, trees) == "step 7: the loss is inf"
    assert guards.nonfinite(7, 0.5, float("nan"), finite, trees).startswith(
        "step 7: gradient ['b'] holds non-finite values (1 of 2"
    )
    ok = {"gradient": np.array([True, True]), "parameter": np.array([True, True])}
    assert "the gradient norm is inf" in guards.nonfinite(7, 0.5, float("inf"), ok, trees)
    assert guards.nonfinite(7, 0.5, 1.0, ok, trees) is None


# ----- 2. checkpoints that prove themselves -----
def tree(seed):
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.standard_normal((64, 96)), jnp.float32),
        "b": jnp.asarray(rng.standard_normal(96), jnp.bfloat16),
        "count": jnp.int32(seed),
    }


def save_two(directory):
    checkpoints = Checkpoints(directory, keep=3)
    for step in (1, 2):
        checkpoints.save(step, tree(step), {"config": {}, "data_rng": step})
    checkpoints.close()
    return Checkpoints(directory, keep=3)


def flip_64_bytes(step_dir):
    """Invert 64 bytes in the middle of the largest array data file (orbax reads it back without error)."""
    data = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 64] = bytes(b ^ 0xFF for b in raw[middle : middle + 64])
    data.write_bytes(bytes(raw))


def bits_equal(a, b):
    return all(
        np.array_equal(np.atleast_1d(x).view(np.uint8), np.atleast_1d(y).view(np.uint8))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_restore_verifies_and_falls_back_past_a_corrupt_checkpoint(tmp_path, caplog):
    checkpoints = save_two(tmp_path / "checkpoints")
    state, meta = checkpoints.restore_newest(tree(0), lambda meta: None)
    assert meta["step"] == 2 and bits_equal(state, tree(2))
    flip_64_bytes(tmp_path / "checkpoints" / "2")
    with pytest.raises(CheckpointError, match=r"checkpoints/2/state: .* recorded checksums, first \['w'\]"):
        checkpoints.restore(2, tree(0), checkpoints.read_meta(2))
    with caplog.at_level(logging.WARNING, logger="train.grpo"):
        state, meta = checkpoints.restore_newest(tree(0), lambda meta: None)
    assert meta["step"] == 1 and bits_equal(state, tree(1))
    assert any("checkpoint 2 is unusable" in r.getMessage() and "['w']" in r.getMessage() for r in caplog.records)
    assert checkpoints.steps() == [1] and (tmp_path / "checkpoints.unusable" / "2" / "state").is_dir()
    checkpoints.save(2, tree(2), {"config": {}, "data_rng": 2})  # the step can be written again
    checkpoints.close()


@pytest.mark.parametrize(
    "damage", ["truncate meta", "garble meta", "truncate array file", "delete meta", "renamed step"]
)
def test_damaged_checkpoint_is_named_in_one_line(tmp_path, damage):
    checkpoints = save_two(tmp_path / "checkpoints")
    step_dir = tmp_path / "checkpoints" / "2"
    meta_file = step_dir / "meta" / "metadata"
    if damage == "truncate meta":
        meta_file.write_bytes(meta_file.read_bytes()[:100])
    elif damage == "garble meta":  # still valid JSON, but not what was written
        meta_file.write_text(meta_file.read_text().replace('"data_rng": 2', '"data_rng": 3'))
    elif damage == "delete meta":
        meta_file.unlink()
    elif damage == "renamed step":  # a whole, valid checkpoint in the wrong step's directory
        step_dir = step_dir.rename(step_dir.parent / "5")
        meta_file = step_dir / "meta" / "metadata"
    else:
        data = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    shutil.rmtree(tmp_path / "checkpoints" / "1")
    checkpoints.manager.reload()
    with pytest.raises(CheckpointError) as error:
        checkpoints.restore_newest(tree(0), lambda meta: None)
    message = str(error.value)
    named = str(step_dir / "state") if damage == "truncate array file" else str(meta_file)
    assert "\n" not in message and named in message and "no usable checkpoint" in message, message


# ----- 2. resume: refused when the trajectory would change; metrics and versions continue -----
@pytest.mark.slow  # a run, a checkpoint written and restored, an HF export
def test_resume_refuses_changed_flags_and_a_fresh_run_over_old_checkpoints(tmp_path):
    base = grpo.GRPOConfig(steps=1, verify_every=0, out=str(tmp_path), admin_key="secret", **SMALL)
    grpo.train(base)
    meta = json.loads((tmp_path / "checkpoints" / "1" / "meta" / "metadata").read_text())
    assert meta["config"]["learning_rate"] == base.optimiser.learning_rate and "admin_key" not in meta["config"]
    changed = dataclasses.replace(
        base, resume=True, optimiser=Optimiser(learning_rate=1e-2), group_size=2, temperature=0.5, keep_checkpoints=5
    )
    with pytest.raises(ValueError) as error:
        grpo.train(changed)
    message = str(error.value)
    for part in (
        "--learning-rate: 0.003 -> 0.01",
        "--group-size: 4 -> 2",
        "--temperature: 1.0 -> 0.5",
        "--resume-allow-changes",
    ):
        assert part in message, message
    assert "--keep-checkpoints" not in message
    grpo.train(dataclasses.replace(changed, resume_allow_changes=True))  # nothing left to run: restores and exports
    with pytest.raises(ValueError, match="already holds checkpoints .1. of an earlier run: --resume"):
        grpo.train(base)


def test_metrics_are_truncated_to_the_restored_step(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "rew')
    with caplog.at_level(logging.WARNING, logger="train.grpo"):
        metrics.keep_metrics_until(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert any("metrics.jsonl:5: dropped an unreadable" in r.getMessage() for r in caplog.records)


def _master_bits(result):
    return [np.asarray(x).view(np.uint32) for x in jax.tree.leaves(result["master"])]


@pytest.mark.slow
def test_resume_past_a_corrupt_checkpoint_is_bit_identical(tmp_path, caplog):
    """Checkpoints 1 and 2; 64 bytes of checkpoint 2 flipped. --resume warns, takes checkpoint 1,
    redoes steps 2-3 and ends with the bits of a run that never stopped; metrics.jsonl holds each step
    once and policy_version continues (0..2, as in the straight run). Warmup spans the whole run, so
    the learning rate does not depend on --steps.
    With --beta > 0: the KL reference is the initial policy, restored from the checkpoint (it was once
    re-taken from the resumed policy and 20 of 24 final tensors differed); the learning rate is high
    enough that the policy at step 2 is far from the initial one."""
    base = grpo.GRPOConfig(
        steps=3,
        checkpoint_every=1,
        optimiser=Optimiser(warmup_steps=10, learning_rate=3e-2),
        beta=0.5,
        verify_every=0,
        **SMALL,
    )
    straight = grpo.train(dataclasses.replace(base, out=str(tmp_path / "a")))
    grpo.train(dataclasses.replace(base, steps=2, out=str(tmp_path / "c")))
    flip_64_bytes(tmp_path / "c" / "checkpoints" / "2")
    with caplog.at_level(logging.WARNING, logger="train.grpo"):
        resumed = grpo.train(dataclasses.replace(base, out=str(tmp_path / "c"), resume=True))
    assert any("checkpoint 2 is unusable" in r.getMessage() for r in caplog.records)
    for x, y in zip(_master_bits(straight), _master_bits(resumed), strict=True):
        assert np.array_equal(x, y)
    rows = [json.loads(line) for line in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    versions = [r["policy_version"] for r in rows]
    assert versions == [r["policy_version"] for r in straight["history"]] == [0, 1, 2]


def test_a_checkpoint_larger_than_the_free_disk_is_refused_before_the_first_step(tmp_path, monkeypatch, caplog):
    """Qwen3-8B's checkpoint (91.5 GiB) on a 64 GiB disk would fail at the first save; it is refused at the start."""
    checkpoints = Checkpoints(tmp_path / "run" / "checkpoints", keep=2)
    state = {"master": {"w": np.zeros(1024, np.float32)}, "opt_state": (np.zeros(2048, np.float32),), "ref": None}
    usage = shutil.disk_usage(tmp_path)
    for free, refused, warned in ((10_000, True, False), (20_000, False, True), (10**9, False, False)):
        monkeypatch.setattr(shutil, "disk_usage", lambda path, free=free: usage._replace(free=free))
        caplog.clear()
        if refused:
            with pytest.raises(ValueError, match=r"holds 0.0 GiB .* --checkpoint-every 0"):
                check_disk(checkpoints, state, 2)
        else:
            check_disk(checkpoints, state, 2)
        assert any("--keep-checkpoints 2" in r.getMessage() for r in caplog.records) == warned
    checkpoints.close()
