"""SFT and LoRA: chat data with a loss mask, `train.init_from`, adapters, merging, and bad input."""

from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from gptcore.chat import encode_conversations, toy_conversations
from gptcore.chat_data import ChatData, prepare_sft
from gptcore.checkpoint import load_checkpoint, save_checkpoint
from gptcore.config import load_config
from gptcore.data import IGNORE_INDEX
from gptcore.errors import UserError
from gptcore.lora import LoRALinear, merge_lora, model_from_state
from gptcore.model import GPT
from gptcore.sample import load_model
from gptcore.tokenizer import IM_END, load_tokenizer, render_chat
from gptcore.train import Trainer
from tests.conftest import (
    WORDS,
    assert_user_error,
    chat_conversation,
    run_cli,
    tiny_config_text,
    write_chat_jsonl,
)

SEQ = 32


def sft_config(chat_data: Path, base: Path, tmp_path: Path, *overrides: str):
    config = tmp_path / "sft.toml"
    config.write_text(tiny_config_text(chat_data, tmp_path / "run", stage="sft", init_from=str(base)))
    return load_config(config, ["train.precision=fp32", *overrides])


# ---------------------------------------------------------------- chat data
def test_the_mask_covers_exactly_the_assistant_content_and_its_end(tiny_data):
    tok = load_tokenizer(tiny_data / "tokenizer.json")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "KING: the crown"},
        {"role": "assistant", "content": "QUEEN: my love"},
        {"role": "user", "content": "and the fool?"},
        {"role": "assistant", "content": "Sweet night."},
    ]
    [(ids, mask)] = encode_conversations(tok, [messages])
    assert ids == tok.encode(render_chat(messages), add_special_tokens=False).ids  # as sampling sees it
    learned = tok.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False)
    assert learned == f"QUEEN: my love{IM_END}Sweet night.{IM_END}"


def test_windows_start_at_conversations_and_skip_prompt_targets(chat_data):
    data = ChatData(chat_data)
    starts, shard, masks = data._starts["train"][0], data._shards["train"][0], data._masks["train"][0]
    args = dict(seed=3, step=5, rank=0, world_size=1, batch_size=6, grad_accum=1, seq_len=SEQ, micro=0)
    x, y = data.train_batch(**args)
    assert x.shape == y.shape == (6, SEQ)
    firsts = {int(shard[s]) for s in starts}
    assert {int(t) for t in x[:, 0]} <= firsts  # every window opens a conversation
    for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
        start = next(s for s in starts if shard[s : s + SEQ].tolist() == row_x[: len(shard[s : s + SEQ])])
        learned = masks[start + 1 : start + SEQ + 1]
        expected = np.where(learned, shard[start + 1 : start + SEQ + 1].astype(np.int64), IGNORE_INDEX)
        assert row_y[: len(expected)] == expected.tolist()
    # two DDP ranks see exactly the windows one worker with twice the batch sees
    whole = data.train_batch(**{**args, "batch_size": 12})[0]
    halves = [data.train_batch(**{**args, "world_size": 2, "rank": r})[0] for r in (0, 1)]
    assert torch.equal(torch.cat(halves), whole)


def test_a_window_past_the_end_of_its_shard_is_padded_and_masked(chat_data):
    data = ChatData(chat_data)
    last = len(data._starts["val"][0]) - 1
    x, y = data._windows("val", [(0, last)], SEQ)
    tail = len(data._shards["val"][0]) - int(data._starts["val"][0][last])
    assert tail < SEQ + 1
    assert (x[0, tail:] == data.eot_id).all() and (y[0, tail - 1 :] == IGNORE_INDEX).all()


def test_the_toy_set_continues_speeches_deterministically():
    scene = (
        "Hamlet\nACT I\n\nHAMLET:\nTo be, or not to be\nthat is the question\n\nExit\n\n"
        "OPHELIA:\nGood my lord\n"
    )
    [conv] = list(toy_conversations(iter([scene])))  # Ophelia's one-line speech has nothing to continue
    assert conv[1] == {"role": "user", "content": "Hamlet in Hamlet: To be, or not to be"}
    assert conv[2] == {"role": "assistant", "content": "that is the question"}


def run_prepare_sft(source: Path, tokenizer: Path, out: Path):
    return run_cli(
        "prepare", "--sft", "--input", str(source), "--tokenizer", str(tokenizer), "--out", str(out)
    )


@pytest.mark.parametrize(
    "line, needle",
    [
        ("{not json", "is not JSON"),
        (json.dumps({"conversations": [{"role": "king", "content": "hi"}]}), "role 'king'"),
        (json.dumps({"conversations": [{"role": "user", "content": "hi"}]}), "no assistant turn"),
        (json.dumps({"messages": []}), "no conversation"),
    ],
)
def test_bad_conversations_are_one_line_and_write_nothing(tiny_data, tmp_path, line, needle):
    source = write_chat_jsonl(tmp_path / "chat.jsonl", n=5)
    source.write_text(source.read_text() + line + "\n")
    out = tmp_path / "out"
    proc = run_prepare_sft(source, tiny_data / "tokenizer.json", out)
    assert_user_error(proc, needle, "chat.jsonl:6")
    assert not out.exists() and list(tmp_path.iterdir()) == [source]


def test_sft_prepare_needs_a_tokenizer_with_the_chat_tokens(tmp_path):
    source = write_chat_jsonl(tmp_path / "chat.jsonl", n=5)
    assert_user_error(
        run_cli("prepare", "--sft", "--input", str(source), "--out", str(tmp_path / "o")), "--tokenizer"
    )
    from tokenizers import Tokenizer, models, pre_tokenizers

    bare = Tokenizer(models.BPE())
    bare.pre_tokenizer = pre_tokenizers.ByteLevel()
    bare.add_special_tokens(["<|endoftext|>"])
    bare.save(str(tmp_path / "bare.json"))
    proc = run_prepare_sft(source, tmp_path / "bare.json", tmp_path / "o")
    assert_user_error(proc, "<|im_start|>", "chat template")
    assert not (tmp_path / "o").exists()


def long_conversation(rng: random.Random, words: int) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": "KING: speak"},
        {"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(words))},
    ]


def test_an_overlong_line_is_skipped_unread_and_counted(tiny_data, tmp_path, capsys):
    """A conversation line over 1 MiB (here 8 MiB, some 2M tokens, of which a window ever sees
    seq_len) is not read whole nor tokenized: it is counted and named in the summary."""
    rng = random.Random(0)
    source = tmp_path / "chat.jsonl"
    lines = [json.dumps({"conversations": chat_conversation(rng)}) for _ in range(40)]
    lines[30] = json.dumps({"conversations": long_conversation(rng, 2_000_000)})
    assert len(lines[30]) > 8 << 20
    source.write_text("\n".join(lines))  # the last line without a newline
    tracemalloc.start()
    try:
        meta = prepare_sft([source], None, tokenizer=tiny_data / "tokenizer.json", out=tmp_path / "out")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 6 << 20, peak  # the 8 MiB line, read whole and decoded, would be 16 MiB
    assert meta["overlong_lines"] == {"skipped": 1, "first": [f"{source}:31"]}
    splits = meta["splits"]
    assert splits["train"]["conversations"] + splits["val"]["conversations"] == 39
    out = capsys.readouterr().out
    assert f"skipped 1 line over 1 MiB (far longer than any window, not tokenized): {source}:31" in out


def test_every_line_overlong_says_they_were_skipped(tiny_data, tmp_path):
    """Not a bare "too few conversations", nor the inputs printed as a Python list."""
    rng = random.Random(0)
    source = tmp_path / "chat.jsonl"
    line = json.dumps({"conversations": long_conversation(rng, 300_000)})
    assert len(line) > 1 << 20
    source.write_text("\n".join([line] * 3) + "\n")
    proc = run_prepare_sft(source, tiny_data / "tokenizer.json", tmp_path / "out")
    assert_user_error(proc, f"{source}: too few conversations", "after skipping 3 lines over 1 MiB")
    assert "['" not in proc.stderr and not (tmp_path / "out").exists()


def test_lengths_past_the_window_are_reported_by_prepare_and_by_the_run(tiny_data, pretrained, tmp_path):
    """prepare --sft does not know seq_len: it counts conversations longer than a window of
    common seq_len values; the run counts, for its own seq_len, the conversations whose tail is
    never learned and their assistant tokens there."""
    rng = random.Random(1)
    conversations = [chat_conversation(rng) for _ in range(60)]
    for i, words in ((3, 400), (7, 40), (45, 150)):  # train conversations (val: 19, 39, 59)
        conversations[i] = long_conversation(rng, words)
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps({"conversations": c}) + "\n" for c in conversations))
    data = tmp_path / "data"
    meta = prepare_sft([source], None, tokenizer=tiny_data / "tokenizer.json", out=data, progress=False)
    encoded = encode_conversations(load_tokenizer(tiny_data / "tokenizer.json"), conversations)
    lengths = np.array([len(ids) for ids, _ in encoded])
    assert meta["conversation_tokens"]["max"] == lengths.max()
    assert meta["conversation_tokens"]["longer_than_window"]["128"] == (lengths > 129).sum() >= 1
    assert meta["conversation_tokens"]["longer_than_window"]["4096"] == 0
    train = [e for i, e in enumerate(encoded) if i % 20 != 19]
    past = [sum(mask[SEQ + 1 :]) for ids, mask in train if len(ids) > SEQ + 1]
    assert len(past) >= 3 and sum(past) > 0
    logs: list[str] = []
    trainer = Trainer(sft_config(data, pretrained, tmp_path, "train.max_steps=1"), log=logs.append)
    trainer.fit()
    learned = meta["splits"]["train"]["learned"]
    assert (
        f"SFT data: {len(past)} of 57 train conversations are longer than a window of model.seq_len=32 "
        f"(the longest has {lengths.max()} tokens); {sum(past)} of their assistant tokens "
        f"({100 * sum(past) / learned:.1f}% of all) lie past it and are never learned" in "\n".join(logs)
    )


def test_sft_prepare_reruns_as_a_no_op_and_refuses_options_it_does_not_take(tiny_data, tmp_path):
    source = write_chat_jsonl(tmp_path / "chat.jsonl", n=40)
    out = tmp_path / "out"
    tokenizer = str(tiny_data / "tokenizer.json")
    proc = run_prepare_sft(source, tiny_data / "tokenizer.json", out)
    assert proc.returncode == 0 and "38 train / 2 val conversations" in proc.stdout, proc.stderr
    written = (out / "meta.json").stat().st_mtime_ns
    proc = run_prepare_sft(source, tiny_data / "tokenizer.json", out)
    assert proc.returncode == 0 and f"{out} is up to date (use --force to rebuild)" in proc.stdout
    assert (out / "meta.json").stat().st_mtime_ns == written
    base = ["prepare", "--sft", "--input", str(source), "--tokenizer", tokenizer, "--out", str(out)]
    proc = run_cli(*base, "--force")
    assert proc.returncode == 0 and "38 train / 2 val" in proc.stdout, proc.stderr
    proc = run_cli(*base, "--val-fraction", "0.1")  # another option: rebuilt, not up to date
    assert proc.returncode == 0 and "36 train / 4 val" in proc.stdout, proc.stderr
    for flag, value, needle in [
        ("--vocab-size", "500", "the vocabulary is --tokenizer's"),
        ("--workers", "2", "the tokenizer's own threads"),
        ("--text-field", "text", "conversations"),
        ("--errors", "replace", "UTF-8"),
        ("--tokenizer-sample-mb", "1", "trains no tokenizer"),
    ]:
        assert_user_error(run_cli(*base, flag, value), f"{flag} does not apply to --sft", needle)
    assert json.loads((out / "meta.json").read_text())["options"]["val_fraction"] == 0.1


# ---------------------------------------------------------------- the SFT stage
def test_sft_starts_from_the_checkpoint_and_learns_only_assistant_tokens(chat_data, pretrained, tmp_path):
    trainer = Trainer(sft_config(chat_data, pretrained, tmp_path), log=None)
    base = load_checkpoint(pretrained)["model"]
    assert all(torch.equal(v, base[k]) for k, v in trainer.model.state_dict().items())
    assert trainer.step == 0  # fresh optimizer and schedule
    x, y = trainer.data.train_batch(
        seed=1, step=0, micro=0, rank=0, world_size=1, batch_size=4, grad_accum=1, seq_len=SEQ
    )
    logits, loss = trainer.model(x, y)
    kept = y != IGNORE_INDEX
    assert 0 < kept.sum() < kept.numel()
    manual = torch.nn.functional.cross_entropy(logits[kept], y[kept])
    torch.testing.assert_close(loss, manual)
    before = trainer.evaluate()["val_loss"]
    trainer.fit()
    assert trainer.evaluate()["val_loss"] < before


def test_stage_and_data_must_agree(chat_data, tiny_data, pretrained, tmp_path):
    with pytest.raises(UserError, match="holds conversations"):
        Trainer(sft_config(chat_data, pretrained, tmp_path, "train.stage=pretrain"), log=None)
    with pytest.raises(UserError, match="documents, not conversations"):
        Trainer(
            sft_config(chat_data, pretrained, tmp_path, f"data.dir={json.dumps(str(tiny_data))}"), log=None
        )


def test_init_from_another_shape_or_tokenizer_is_refused(chat_data, pretrained, tmp_path):
    with pytest.raises(UserError, match="another model shape"):
        Trainer(sft_config(chat_data, pretrained, tmp_path, "model.n_layer=3"), log=None)
    state = load_checkpoint(pretrained)
    other = save_checkpoint(tmp_path / "other.pt", {**state, "tokenizer_sha256": "0" * 64})
    with pytest.raises(UserError, match="another tokenizer"):
        Trainer(sft_config(chat_data, other, tmp_path), log=None)


# ---------------------------------------------------------------- LoRA
def test_lora_trains_only_adapters_and_its_checkpoint_names_its_base(chat_data, pretrained, tmp_path):
    trainer = Trainer(sft_config(chat_data, pretrained, tmp_path, "lora.rank=4", "optim.lr=1e-2"), log=None)
    frozen = {k: v.clone() for k, v in trainer.model.state_dict().items() if ".lora_" not in k}
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    before = trainer.evaluate()["val_loss"]
    trainer.fit()
    assert trainer.evaluate()["val_loss"] < before
    after = trainer.model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in frozen.items())  # the base never moved
    state = trainer.state_dict()
    assert set(state["model"]) == {n for n in trainable}
    assert state["lora_base"]["path"] == str(pretrained.resolve())

    # merged and unmerged models give the same logits
    path = save_checkpoint(tmp_path / "lora.pt", state)
    merged, _ = load_model(path, torch.device("cpu"))
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    x = torch.randint(0, 384, (2, SEQ))
    trainer.model.eval()
    torch.testing.assert_close(merged(x)[0], trainer.model(x)[0], atol=1e-5, rtol=0)


def test_lora_resume_is_bit_identical(chat_data, pretrained, tmp_path):
    cfg = sft_config(chat_data, pretrained, tmp_path, "lora.rank=4", "optim.lr=1e-2")
    full = Trainer(cfg, log=None)
    full.fit()
    first, saved = Trainer(cfg, log=None), {}
    first.fit(on_report=lambda m, state: saved.update(state=state) if state else None, stop_at_step=4)
    second = Trainer(cfg, log=None)
    second.load_state_dict(load_checkpoint(save_checkpoint(tmp_path / "mid.pt", saved["state"])))
    second.fit()
    for a, b in zip(full.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_merge_folds_the_update_into_the_weights():
    torch.manual_seed(0)
    model = GPT(load_config(None, ["model.preset=tiny", "model.vocab_size=64"]).model)
    from gptcore.config import LoraConfig
    from gptcore.lora import add_lora

    summary = add_lora(model, LoraConfig(rank=2, alpha=4.0, targets=["attn.qkv", "mlp"]))
    assert "on 6 linears" in summary  # 2 blocks x (qkv + fc + proj)
    for m in model.modules():
        if isinstance(m, LoRALinear):
            torch.nn.init.normal_(m.lora_B)  # B starts at zero: make the update visible
    x = torch.randint(0, 64, (2, 16))
    unmerged = model(x)[0]
    torch.testing.assert_close(merge_lora(model)(x)[0], unmerged, atol=1e-5, rtol=0)


def test_lora_bad_settings_are_refused(chat_data, pretrained, tmp_path):
    with pytest.raises(UserError, match="match no linear"):
        Trainer(
            sft_config(chat_data, pretrained, tmp_path, "lora.rank=4", 'lora.targets=["attn.nope"]'), log=None
        )
    with pytest.raises(UserError, match="needs train.init_from"):
        load_config(None, ["lora.rank=8"])


def test_a_lora_checkpoint_whose_base_changed_is_refused(chat_data, pretrained, tmp_path):
    trainer = Trainer(sft_config(chat_data, pretrained, tmp_path, "lora.rank=2"), log=None)
    state = trainer.state_dict()
    moved = {**state, "lora_base": {**state["lora_base"], "path": str(tmp_path / "gone.pt")}}
    with pytest.raises(UserError, match="needs its base checkpoint"):
        model_from_state(moved)
    changed = {**state, "lora_base": {**state["lora_base"], "weights_sha256": "0" * 64}}
    with pytest.raises(UserError, match="other weights"):
        model_from_state(changed)


def test_cli_pretrain_then_sft_then_sample(chat_data, pretrained, tmp_path):
    config = tmp_path / "sft.toml"
    config.write_text(tiny_config_text(chat_data, tmp_path / "run", stage="sft", init_from=str(pretrained)))
    proc = run_cli("train", str(config), "--local", "--set", "lora.rank=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LoRA rank 4" in proc.stdout and "trainable" in proc.stdout
    proc = run_cli(
        "sample",
        str(tmp_path / "run" / "checkpoints" / "last.pt"),
        "--prompt",
        "KING:",
        "--max-new-tokens",
        "8",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    missing = tmp_path / "none.pt"
    config.write_text(tiny_config_text(chat_data, tmp_path / "run2", stage="sft", init_from=str(missing)))
    assert_user_error(run_cli("train", str(config), "--local"), "none.pt")


def test_a_lora_checkpoint_exports_merged(chat_data, pretrained, tmp_path, monkeypatch):
    """The exported Hugging Face model gives the LoRA model's logits (adapters merged)."""
    import transformers

    from gptcore.export import export_hf

    trainer = Trainer(sft_config(chat_data, pretrained, tmp_path, "lora.rank=4", "optim.lr=1e-2"), log=None)
    trainer.fit()
    path = save_checkpoint(tmp_path / "lora.pt", trainer.state_dict())
    export_hf(path, tmp_path / "hf")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, 384, (2, SEQ))
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(hf_model(x).logits, trainer.model(x)[0], atol=1e-5, rtol=0)
