"""The examples run as the README says, and their losses go down; the docs' recipes run."""

import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, *args):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    return out, [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]


def test_train_mlp_trains_checkpoints_and_resumes():
    out, losses = run("train_mlp.py", "--steps", "150")
    assert "resumed into a fresh state" in out and "state bytes on host" in out
    after, before = re.search(r"full-batch loss (\d+\.\d+) \(was (\d+\.\d+)", out).groups()
    assert float(after) < float(before) < losses[0]


def test_train_both_trains():
    out, losses = run("train_both.py", "--steps", "40")
    assert losses[-1] < 0.5 * losses[0]


def doc_block(doc: str, heading: str) -> str:
    """The first ```python block under ``heading`` in ``docs/<doc>``."""
    with open(os.path.join(ROOT, "docs", doc)) as f:
        text = f.read()
    return re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S).group(1)


def test_the_trainer_recipe_of_the_migration_guide_trains(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import functional_offload as fo

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": x, "labels": x} for x in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=3e-3,
        weight_decay=0.1, max_grad_norm=1.0, save_strategy="no", logging_strategy="no",
        report_to="none", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    monkeypatch.chdir(tmp_path)
    scope = {"model": model, "args": args, "dataset": dataset}
    exec(doc_block("migration.md", "### In `transformers.Trainer`"), scope)
    trainer = scope["trainer"]
    assert isinstance(trainer.optimizer.optimizer, fo.TorchOptimizer)
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.1, 0.0]
    state = trainer.optimizer.optimizer.fo_states[0]
    assert int(state.count) == 2 and fo.placement_report(state).device_bytes == 0
    assert any(not torch.equal(before[k], v) for k, v in model.named_parameters())


def user_docs() -> dict[str, str]:
    names = ["README.md"] + [os.path.join("docs", n) for n in sorted(os.listdir(os.path.join(ROOT, "docs")))
                             if n.endswith(".md")]
    out = {}
    for name in names:
        with open(os.path.join(ROOT, name)) as f:
            out[name] = f.read()
    return out


def test_the_docs_speak_of_the_project_alone():
    """No work periods, reviews or tickets of the people who wrote it: dates and commits."""
    internal = re.compile(r"\bsessions?\b|red[- ]team|\bCEO\b|\bsubmitted\b|\bissues? #?\d", re.I)
    for name, text in user_docs().items():
        found = internal.findall(text)
        assert not found, (name, found)
    perf = user_docs()[os.path.join("docs", "performance.md")]
    assert not re.findall(r"\bruns? \d", perf)  # numbers carry their dates and commits


def test_every_benchmark_entry_has_its_date_and_commit():
    text = user_docs()[os.path.join("docs", "benchmarks.md")]
    entries = re.findall(r"^##+ .*\b[Rr]uns? \d.*$", text, re.M)
    assert len(entries) > 60
    for heading in entries:
        assert re.search(r"\b2026-\d\d-\d\d\b", heading), heading
        assert re.search(r"\b[0-9a-f]{7}\b", heading), heading


def test_the_docs_relative_links_and_images_exist():
    """Every relative link or image of the README and the docs names a file of the repository."""
    for name, text in user_docs().items():
        for target in re.findall(r"\]\(([^)\s#]+)[^)]*\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(name), target))
            assert os.path.exists(path), (name, target)
