"""`gptrun export --hf`: the folder transformers loads offline gives our logits, our greedy tokens
and our chat template; a Ray Train folder exports like a `.pt` file; bad input is one line and
writes nothing.

The checkpoints are real (`save_checkpoint` of a Trainer's state, the tiny model in both styles,
every parameter jittered so that norm gains and biases are not their 1/0 init). The exported
folders are loaded in a fresh interpreter with HF_HUB_OFFLINE=1, as a user would."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from experiments.cli import main
from gptcore.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint
from gptcore.config import load_config
from gptcore.errors import UserError
from gptcore.export import export_hf
from gptcore.run import train_local
from gptcore.sample import load_model, sample_cli
from gptcore.tokenizer import EOT, IM_END, IM_START, render_chat
from gptcore.train import Trainer
from tests.conftest import assert_user_error, run_cli, synthetic_documents, tiny_config_text

LLAMA = ['model.style="llama"', "model.n_head=4", "model.n_kv_head=2", "model.rope_theta=500.0"]
# µP at m = 4 (d_model 64, base 16): the logits' 1/4 must reach transformers through the weights.
STYLES = {
    "gpt2": [],
    "llama": LLAMA,
    "gpt2-mup": ["model.mup_base_width=16"],
    "llama-mup": [*LLAMA, "model.mup_base_width=16"],
}
MESSAGES = [
    {"role": "system", "content": "Answer as the queen."},
    {"role": "user", "content": "KING: Good day, sweet lord."},
    {"role": "assistant", "content": "QUEEN: And to thee."},
    {"role": "user", "content": "KING: The crown?"},
]
TEXT = "<|im_start|>user\nKING: Thy crown doth shine.<|im_end|>\n<|endoftext|>"
NEW_TOKENS = 12

# Run by a fresh interpreter: load each exported folder offline and record what transformers makes
# of it.
OFFLINE_LOAD = """
import sys, torch, transformers
inputs = torch.load(sys.argv[1])
results = {}
for style, folder in inputs["folders"].items():
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        logits = model(inputs["ids"]).logits
    out = model.generate(inputs["prompt"], max_new_tokens=inputs["new_tokens"], do_sample=False)
    results[style] = dict(
        cls=type(model).__name__,
        logits=logits,
        generated=out[0, inputs["prompt"].size(1):].tolist(),
        chat=tok.apply_chat_template(inputs["messages"], tokenize=False, add_generation_prompt=True),
        ids=tok(inputs["text"]).input_ids,
        specials=[tok.bos_token, tok.eos_token, tok.pad_token],
        eos=model.generation_config.eos_token_id,
        pad=model.generation_config.pad_token_id,
    )
torch.save(results, sys.argv[2])
"""


def tiny_checkpoint(data: Path, root: Path, name: str, overrides: list[str]) -> Path:
    """A real checkpoint of the tiny model on `data`, every parameter jittered."""
    config = root / f"{name}.toml"
    config.write_text(tiny_config_text(data, root / name))
    trainer = Trainer(load_config(config, ["train.precision=fp32", *overrides]), log=None)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return save_checkpoint(root / f"{name}.pt", trainer.state_dict())


@pytest.fixture(scope="module")
def checkpoints(tiny_data, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export_ckpt")
    paths = {style: tiny_checkpoint(tiny_data, root, style, o) for style, o in STYLES.items()}
    folder = root / "ray" / "checkpoint_000002"  # the layout experiments/ray_train.py reports
    folder.mkdir(parents=True)
    (folder / CHECKPOINT_FILE).write_bytes(paths["gpt2"].read_bytes())
    paths["ray"] = folder
    return paths


@pytest.fixture(scope="module")
def exported(checkpoints, tmp_path_factory) -> dict[str, Path]:
    """Each style exported by `gptrun export`: gpt2 from the Ray Train folder through the command
    line, the others from their .pt through the same entry point in this process (a subprocess
    each would only add torch's and transformers' imports)."""
    root = tmp_path_factory.mktemp("export_hf")
    out = {}
    sources = {**{style: checkpoints[style] for style in STYLES}, "gpt2": checkpoints["ray"]}
    for style, source in sources.items():
        out[style] = root / style
        args = ["export", str(source), "--hf", str(out[style])]
        if style == "gpt2":
            proc = run_cli(*args)
            assert proc.returncode == 0, proc.stderr
            printed = proc.stdout
        else:
            with contextlib.redirect_stdout(io.StringIO()) as stdout:
                assert main(args) == 0
            printed = stdout.getvalue()
        assert f"to {out[style]}" in printed
    return out


@pytest.fixture(scope="module")
def loaded(exported, tmp_path_factory) -> tuple[dict, dict]:
    """(inputs, what a fresh offline interpreter's transformers computed on them)."""
    root = tmp_path_factory.mktemp("export_load")
    gen = torch.Generator().manual_seed(0)
    inputs = dict(
        folders={style: str(path) for style, path in exported.items()},
        ids=torch.randint(3, 384, (2, 32), generator=gen),
        prompt=torch.randint(3, 384, (1, 5), generator=gen),
        new_tokens=NEW_TOKENS,
        messages=MESSAGES,
        text=TEXT,
    )
    torch.save(inputs, root / "inputs.pt")
    proc = subprocess.run(
        [sys.executable, "-c", OFFLINE_LOAD, str(root / "inputs.pt"), str(root / "results.pt")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return inputs, torch.load(root / "results.pt")


@pytest.mark.parametrize(
    "style, cls",
    [
        ("gpt2", "GPT2LMHeadModel"),
        ("llama", "LlamaForCausalLM"),
        ("gpt2-mup", "GPT2LMHeadModel"),
        ("llama-mup", "LlamaForCausalLM"),
    ],
)
def test_exported_model_gives_our_logits_and_greedy_tokens(checkpoints, loaded, style, cls):
    inputs, results = loaded
    theirs = results[style]
    assert theirs["cls"] == cls
    model, _ = load_model(checkpoints[style], torch.device("cpu"))
    with torch.no_grad():
        logits, _ = model(inputs["ids"])
    torch.testing.assert_close(theirs["logits"], logits, rtol=0, atol=1e-5)
    ours = model.generate(inputs["prompt"], NEW_TOKENS, temperature=0.0)[0, 5:].tolist()
    hf = theirs["generated"]  # transformers stops at an eos token, ours (no stop_token) does not
    assert len(hf) >= 4 and hf == ours[: len(hf)]
    assert len(hf) == NEW_TOKENS or hf[-1] in theirs["eos"]


@pytest.mark.parametrize("style", list(STYLES))
def test_exported_tokenizer_has_our_ids_special_tokens_and_chat_template(tiny_data, exported, loaded, style):
    theirs = loaded[1][style]
    tok = Tokenizer.from_file(str(tiny_data / "tokenizer.json"))
    assert theirs["chat"] == render_chat(MESSAGES, add_generation_prompt=True)
    assert theirs["ids"] == tok.encode(TEXT).ids
    assert theirs["specials"] == [IM_START, IM_END, EOT]
    assert theirs["eos"] == [tok.token_to_id(IM_END), tok.token_to_id(EOT)]
    assert theirs["pad"] == tok.token_to_id(EOT)
    files = {p.name for p in exported[style].iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= files
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(exported[style].stat().st_mode) == 0o777 & ~umask  # as mkdir makes it


def test_a_ray_train_folder_exports_like_its_pt_file(checkpoints, exported, tmp_path):
    export_hf(checkpoints["gpt2"], tmp_path / "from_pt")
    from_folder = sorted(p.name for p in exported["gpt2"].iterdir())
    assert sorted(p.name for p in (tmp_path / "from_pt").iterdir()) == from_folder
    for name in from_folder:
        assert (tmp_path / "from_pt" / name).read_bytes() == (exported["gpt2"] / name).read_bytes(), name


def test_a_checkpoint_carries_its_tokenizer_away_from_its_data_folder(tiny_data, tmp_path, monkeypatch):
    """A run on a relative --data: its checkpoint, copied elsewhere as a .pt file and as a Ray
    Train folder, samples and exports with the data folder gone. A checkpoint from before
    checkpoints carried their tokenizer still finds it through data.dir, and one carrying
    another tokenizer than it recorded is refused."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    shutil.copytree(tiny_data, project / "data")
    monkeypatch.chdir(project)
    (project / "exp.toml").write_text(tiny_config_text(Path("data"), Path("run")))
    train_local(load_config(project / "exp.toml", ["train.precision=fp32", "train.max_steps=4"]))
    state = load_checkpoint("run/checkpoints/last.pt")
    assert state["config"]["data"]["dir"] == "data"  # saved as given
    old = save_checkpoint(elsewhere / "old.pt", {k: v for k, v in state.items() if k != "tokenizer_json"})
    knobs = dict(max_new_tokens=8, temperature=0.0, top_k=0, top_p=1.0, seed=0, use_cache=True, device="cpu")
    expected = sample_cli(str(old), prompt="KING:", tokenizer=None, **knobs)  # found through data.dir
    ray_folder = elsewhere / "checkpoint_000001"
    ray_folder.mkdir()
    shutil.copyfile("run/checkpoints/last.pt", ray_folder / CHECKPOINT_FILE)
    shutil.copyfile("run/checkpoints/last.pt", elsewhere / "model.pt")
    monkeypatch.chdir(elsewhere)
    shutil.rmtree(project)
    for checkpoint in ("model.pt", ray_folder.name):
        assert sample_cli(checkpoint, prompt="KING:", tokenizer=None, **knobs) == expected
    export_hf("model.pt", "hf")
    original = Tokenizer.from_file(str(tiny_data / "tokenizer.json"))
    assert Tokenizer.from_file("hf/tokenizer.json").get_vocab() == original.get_vocab()
    with pytest.raises(UserError, match="carries no tokenizer .* data/tokenizer.json.* --tokenizer PATH"):
        sample_cli("old.pt", prompt="KING:", tokenizer=None, **knobs)
    given = sample_cli("old.pt", prompt="KING:", tokenizer=str(tiny_data / "tokenizer.json"), **knobs)
    assert given == expected
    other = save_checkpoint("other.pt", {**state, "tokenizer_json": state["tokenizer_json"] + " "})
    with pytest.raises(UserError, match="carries is not the one it recorded"):
        export_hf(other, "hf-other")


def test_non_empty_folder_needs_force_and_nothing_is_half_written(checkpoints, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert_user_error(run_cli("export", str(checkpoints["llama"]), "--hf", str(out)), "not empty", "--force")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    export_hf(checkpoints["llama"], out, force=True)
    assert "notes.txt" not in {p.name for p in out.iterdir()} and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temp or old folder left beside it


def test_gpt2_with_grouped_query_attention_is_refused_before_writing(tiny_data, tmp_path):
    gqa = tiny_checkpoint(tiny_data, tmp_path, "gqa", ["model.n_head=4", "model.n_kv_head=2"])
    with pytest.raises(UserError, match="GPT2LMHeadModel has no grouped-query attention"):
        export_hf(gqa, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf*"))


def test_tokenizer_without_chat_tokens_is_one_line_for_export_and_chat(tmp_path, capsys):
    """A byte-level BPE of the user's own, with <|endoftext|> but no chat tokens."""
    from gptcore.prepare import prepare

    plain = Tokenizer(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    plain.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOT], initial_alphabet=alphabet, show_progress=False
    )
    plain.train_from_iterator(synthetic_documents(40), trainer=trainer)
    plain.save(str(tmp_path / "plain.json"))
    (tmp_path / "corpus.txt").write_text(EOT.join(synthetic_documents(40)))
    data = tmp_path / "data"
    prepare(
        [tmp_path / "corpus.txt"],
        None,
        data,
        val_fraction=0.1,
        tokenizer=tmp_path / "plain.json",
        progress=False,
    )
    ckpt = tiny_checkpoint(data, tmp_path, "plain", [f"model.vocab_size={plain.get_vocab_size()}"])
    needle = "has no <|im_start|> or <|im_end|> token"
    assert_user_error(run_cli("export", str(ckpt), "--hf", str(tmp_path / "hf")), needle)
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf*"))
    assert main(["sample", str(ckpt), "--chat", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err
