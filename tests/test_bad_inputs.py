"""Bad input and hostile use through the command line and the API, one case per test: each is one clear error
naming the bad value (the CLI: exit status 2 and one line on stderr, never a traceback), and nothing is run that
should not be (no pickle is executed, no terabyte is allocated). The server's cases are in test_serve.py."""

from __future__ import annotations

import math
import pickle
import shutil
from pathlib import Path

import pytest
import torch

import adaptree
from adaptree import cli
from adaptree.core.verify import MIN_TEMPERATURE, SamplingConfig
from adaptree.models import load_target
from adaptree.models.eagle3 import Eagle3Head


def generate(model: Path, *flags: str, draft: Path | str = "none") -> list[str]:
    return ["generate", "--model", str(model), "--draft", str(draft), "--dtype", "float32", "--no-adapt",
            "--max-new-tokens", "3", *flags, "the cat sat"]


def fails(argv: list[str], capsys) -> str:
    """Run the CLI in this process: exit status 2 and one line on stderr (returned), no traceback."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("adaptree: error: "), err
    return lines[0]


def head_copy(head: Path, where: Path) -> Path:
    shutil.copytree(head, where)
    return where


# ----------------------------------------------------------------------------------------------- head folders


def test_a_truncated_head_safetensors_names_the_file(tiny_folders, tmp_path, capsys):
    model, head = tiny_folders
    bad = head_copy(head, tmp_path / "head")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:1000])
    line = fails(generate(model, "--method", "static", draft=bad), capsys)
    assert str(bad / "model.safetensors") in line and "truncated or corrupt" in line


def test_a_head_config_that_is_not_an_object_names_the_file(tiny_folders, tmp_path, capsys):
    model, head = tiny_folders
    bad = head_copy(head, tmp_path / "head")
    (bad / "config.json").write_text("[1]")
    line = fails(generate(model, "--method", "static", draft=bad), capsys)
    assert str(bad / "config.json") in line and "expected a JSON object" in line and "[1]" in line


def test_a_head_config_field_of_the_wrong_type_names_the_file(tiny_folders, tmp_path):
    model, head = tiny_folders
    bad = head_copy(head, tmp_path / "head")
    cfg = (bad / "config.json").read_text().replace('"rope_theta": ', '"rope_theta": [1], "was": ', 1)
    (bad / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match="config.json: a field has the wrong type"):
        Eagle3Head.from_pretrained(bad, load_target(model)[0])


def test_a_garbage_pytorch_model_bin_is_refused_with_the_way_out(tiny_folders, tmp_path, capsys):
    model, head = tiny_folders
    bad = tmp_path / "head"
    bad.mkdir()
    shutil.copy(head / "config.json", bad / "config.json")
    (bad / "pytorch_model.bin").write_bytes(bytes(range(256)) * 12)
    line = fails(generate(model, "--method", "static", draft=bad), capsys)
    assert str(bad / "pytorch_model.bin") in line and "convert the head to model.safetensors" in line
    assert "weights_only=False" not in line  # torch's own advice would be to run the pickle


class _Planted:
    """Unpickling this creates ``path``: proof that a pickle was run (a real attack would run any code)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_a_pickle_that_runs_code_is_never_run(tiny_folders, tmp_path):
    model, head = tiny_folders
    bad = tmp_path / "head"
    bad.mkdir()
    shutil.copy(head / "config.json", bad / "config.json")
    marker = tmp_path / "ran"
    torch.save({"fc.weight": _Planted(marker)}, bad / "pytorch_model.bin")
    with pytest.raises(ValueError, match="not a weights-only PyTorch checkpoint"):
        Eagle3Head.from_pretrained(bad, load_target(model)[0])
    assert not marker.exists()
    # a plain pickle (not torch's zip format) is not loaded either
    (bad / "pytorch_model.bin").write_bytes(pickle.dumps({"fc.weight": _Planted(marker)}, protocol=2))
    with pytest.raises(ValueError, match="convert the head to model.safetensors"):
        Eagle3Head.from_pretrained(bad, load_target(model)[0])
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------ model flags


def test_a_context_past_the_models_is_refused_before_anything_is_allocated(tiny_folders, capsys):
    model, _ = tiny_folders
    line = fails(generate(model, "--max-seq-len", "1000000000000"), capsys)
    assert "max_seq_len must be in 2..256" in line and "got 1000000000000" in line
    with pytest.raises(ValueError, match="got 257"):
        adaptree.load(model, head=None, dtype="float32", max_seq_len=257, adapt=False)
    assert adaptree.load(model, head=None, dtype="float32", max_seq_len=256, adapt=False).engine.max_len == 256


def test_a_temperature_too_small_to_sample_is_refused(tiny_folders, capsys):
    model, _ = tiny_folders
    line = fails(generate(model, "--temperature", "1e-40"), capsys)
    assert f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got 1e-40" in line
    for bad in (1e-40, 5e-324, MIN_TEMPERATURE / 2):
        with pytest.raises(ValueError, match="temperature must be 0"):
            SamplingConfig(temperature=bad)
    with pytest.raises(ValueError, match="temperature must be finite"):
        SamplingConfig(temperature=math.inf)
    from adaptree.core.batched import batched_decode  # head-training corpora and chain calibrations sample here

    with pytest.raises(ValueError, match="got 1e-40"):
        batched_decode(load_target(model)[0], [[5, 6]], 3, temperature=1e-40)


def test_sampling_at_the_smallest_temperature_is_finite_and_greedy(tiny_folders):
    """At MIN_TEMPERATURE logits / T stays finite (no NaN in torch.multinomial) and, with no exact ties in the tiny
    model's logits, every sampled token is the greedy one, through a tree and autoregressively."""
    model, head = tiny_folders
    pipe = adaptree.load(model, head=head, dtype="float32", adapt=False)
    ids = [5, 6, 7, 8]
    greedy = pipe.generate(ids, method="ar", max_new_tokens=24).token_ids
    cold = SamplingConfig(temperature=MIN_TEMPERATURE, seed=0)
    assert pipe.generate(ids, method="ar", max_new_tokens=24, sampling=cold).token_ids == greedy
    assert pipe.generate(ids, method="static", max_new_tokens=24, sampling=cold, width=3, depth=3,
                         size=6).token_ids == greedy


def test_gammatune_max_factor_past_the_depth_cap_is_refused(tiny_folders, capsys):
    model, head = tiny_folders
    line = fails(generate(model, "--method", "gammatune", "--gammatune-max-factor", "1e308", draft=head), capsys)
    assert "max_factor must be in [1, 64], got 1e+308" in line


def test_ngram_max_n_past_the_context_index_is_refused(tiny_folders, capsys):
    model, head = tiny_folders
    line = fails(generate(model, "--method", "ngram", "--ngram-max-n", "65", draft=head), capsys)
    assert "max_n must be <= 64" in line and "got 65" in line


# ---------------------------------------------------------------------------------------------------- prompts


def test_a_question_line_that_is_not_an_object_names_the_line(tiny_folders, tmp_path, capsys):
    model, _ = tiny_folders
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question_id": 1, "turns": ["hi"]}\n[1, 2, 3]\n')
    line = fails(["traces", "record", "--model", str(model), "--draft", "none", "--dtype", "float32", "--datasets", "",
                  "--question-file", str(questions), "--out", str(tmp_path / "traces")], capsys)
    assert f"{questions}:2: a question must be a JSON object with 'turns', got [1, 2, 3]" in line


def test_an_empty_question_file_is_an_error_naming_it(tiny_folders, tmp_path, capsys):
    """The bench used to run no prompt at all and crash drawing its plots."""
    model, _ = tiny_folders
    questions = tmp_path / "empty.jsonl"
    questions.write_text("\n\n")
    line = fails(["bench", "--model", str(model), "--draft", "none", "--dtype", "float32", "--no-adapt", "--methods",
                  "ar", "--datasets", "", "--question-file", str(questions), "--out", str(tmp_path / "bench")], capsys)
    assert f"question file {str(questions)!r} holds no questions" in line


def test_a_report_of_no_runs_draws_no_plots(tmp_path):
    from adaptree.bench.report import write_plots

    assert write_plots({"results": {}, "greedy": True, "reference": None, "skipped": []}, tmp_path) == []


# -------------------------------------------------------------------------------------------------------- API


def test_a_prompt_id_outside_the_vocabulary_is_named(tiny_folders):
    model, _ = tiny_folders
    pipe = adaptree.load(model, head=None, dtype="float32", adapt=False)
    vocab = pipe.target.config.vocab_size
    for bad in (10 ** 9, vocab, -1):
        with pytest.raises(ValueError, match=rf"prompt token id {bad} is outside the vocabulary \(0..{vocab - 1}\)"):
            pipe.generate([5, bad], max_new_tokens=2)
    assert len(pipe.generate([5, vocab - 1], max_new_tokens=2).token_ids) == 2
