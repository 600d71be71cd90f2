"""Chat sampling: `gptrun sample --chat` (one reply, up to <|im_end|>) and `--interactive` (turns
from stdin, history kept and trimmed from the oldest exchange to fit the model).

The model here is a real checkpoint of the tiny model whose weights are set so that its greedy
output depends on the position only: the token at position p is SCRIPT[p], and every K-th token is
<|im_end|>. So each reply is known exactly from the length of its prompt, which makes the prompt
that the history rules built visible in the output."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from experiments.cli import main
from gptcore.checkpoint import CHECKPOINT_FILE, save_checkpoint
from gptcore.model import GPT
from gptcore.sample import Sampler, fit_history, load_model, sample_cli
from gptcore.tokenizer import IM_END, render_chat
from gptcore.train import Trainer
from tests.conftest import run_cli, tiny_config_text

K = 6  # <|im_end|> at every position p with p % K == K - 1
MAX_NEW = 24
GREEDY = dict(max_new_tokens=MAX_NEW, temperature=0.0, top_k=0, top_p=1.0, seed=0, use_cache=True)


@pytest.fixture(scope="module")
def scripted(tiny_data, tmp_path_factory):
    """(checkpoint, tokenizer, script): the tiny model (128 positions) made to write SCRIPT."""
    from gptcore.config import load_config

    root = tmp_path_factory.mktemp("chat_sample")
    config = root / "exp.toml"
    config.write_text(tiny_config_text(tiny_data, root / "run"))
    trainer = Trainer(load_config(config, ["train.precision=fp32", "model.max_positions=128"]), log=None)
    tok = Tokenizer.from_file(str(tiny_data / "tokenizer.json"))
    words = [i for i in range(3, tok.get_vocab_size()) if tok.decode([i]).strip().isalpha()]
    im_end = tok.token_to_id(IM_END)
    script = [im_end if p % K == K - 1 else words[(5 * p) % len(words)] for p in range(128)]
    model = trainer.model
    with torch.no_grad():  # blocks add nothing; the position embedding points at SCRIPT[p]
        for block in model.blocks:
            for proj in (block.attn.proj, block.mlp.proj):
                proj.weight.zero_()
                proj.bias.zero_()
        model.pos_emb.weight.copy_(100 * model.tok_emb.weight[script])
    folder = root / "checkpoint_000000"  # a Ray Train checkpoint folder
    save_checkpoint(folder / CHECKPOINT_FILE, trainer.state_dict())
    return folder, tok, script


def expected_reply(tok: Tokenizer, script: list[int], messages: list[dict[str, str]]) -> str:
    """What the scripted model answers to `messages`: SCRIPT from the prompt's end to <|im_end|>."""
    p = len(tok.encode(render_chat(messages, add_generation_prompt=True)).ids) - 1
    ids = []
    while script[p] != tok.token_to_id(IM_END):
        ids.append(script[p])
        p += 1
    return tok.decode(ids)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def test_chat_replies_stop_at_im_end_and_print_the_reply_only(scripted, capsys, monkeypatch):
    folder, tok, script = scripted
    outputs: list[torch.Tensor] = []
    generate = GPT.generate
    monkeypatch.setattr(GPT, "generate", lambda *a, **kw: outputs.append(generate(*a, **kw)) or outputs[-1])
    for system, text in ((None, "KING: Good day"), ("Answer as the queen.", "KING: Sweet lord, the crown")):
        messages = [{"role": "system", "content": system}] if system else []
        messages.append(user(text))
        reply = sample_cli(
            str(folder), prompt=text, system=system, chat=True, tokenizer=None, device="cpu", **GREEDY
        )
        assert reply == expected_reply(tok, script, messages)
        assert capsys.readouterr().out == reply + "\n"
        prompt = tok.encode(render_chat(messages, add_generation_prompt=True)).ids
        new = outputs[-1][0].tolist()[len(prompt) :]
        assert outputs[-1][0].tolist()[: len(prompt)] == prompt  # the template, system included
        assert new[-1] == tok.token_to_id(IM_END) and len(new) < MAX_NEW  # stopped there
        assert reply and "<|im" not in reply and "assistant" not in reply


def test_history_drops_whole_exchanges_from_the_oldest(scripted):
    folder, tok, _ = scripted
    model, _state = load_model(folder, torch.device("cpu"))
    sampler = Sampler(model, tok, **GREEDY)
    assert sampler.history_limit() == 128 - MAX_NEW
    system = [{"role": "system", "content": "Be brief."}]
    turns = []
    for i in range(6):
        turns += [user(f"KING: the king speaks {i}"), {"role": "assistant", "content": f"QUEEN: my lord {i}"}]
    turns.append(user("KING: last"))
    kept = fit_history(sampler, system, turns)

    def length(ts: list[dict[str, str]]) -> int:
        return len(sampler.prompt_ids(system + ts))

    assert kept == turns[len(turns) - len(kept) :] and kept[0]["role"] == "user"
    assert 1 < len(kept) < len(turns)  # some history kept, some dropped
    assert length(kept) <= sampler.history_limit() < length(turns[len(turns) - len(kept) - 2 :])
    # A last turn too long to fit alone stays: the model reads its last positions.
    huge = [user("KING: " + "the king " * 80)]
    assert length(huge) > sampler.history_limit()
    assert fit_history(sampler, system, [*turns[:-1], *huge]) == huge


def test_interactive_chat_reads_turns_from_stdin_until_eof(scripted):
    folder, tok, script = scripted
    lines = ["KING: Good day", "", "KING: The crown", "KING: Night", "KING: Love and death"]
    proc = run_cli(
        "sample",
        str(folder),
        "--chat",
        "--interactive",
        "--system",
        "Be the queen.",
        "--temperature",
        "0",
        "--max-new-tokens",
        str(MAX_NEW),
        stdin="\n".join(lines) + "\n",
    )
    assert proc.returncode == 0, proc.stderr
    replies = proc.stdout.splitlines()
    assert len(replies) == 4  # one per non-empty line
    # The history the limit (128 - 24 = 104 prompt tokens) allows: written out, not recomputed.
    system = {"role": "system", "content": "Be the queen."}
    u1, u2, u3, u4 = (user(line) for line in lines if line)
    a1, a2, a3 = ({"role": "assistant", "content": r} for r in replies[:3])
    prompts = [[system, u1], [system, u1, a1, u2], [system, u1, a1, u2, a2, u3], [system, u2, a2, u3, a3, u4]]
    for messages, reply in zip(prompts, replies, strict=True):
        assert reply == expected_reply(tok, script, messages)
    limit = 128 - MAX_NEW
    full = [system, u1, a1, u2, a2, u3, a3, u4]
    assert len(tok.encode(render_chat(full, add_generation_prompt=True)).ids) > limit
    assert len(tok.encode(render_chat(prompts[3], add_generation_prompt=True)).ids) <= limit


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--interactive"], "--interactive is for chat sampling; add --chat"),
        (["--system", "x"], "--system is for chat sampling; add --chat"),
        (["--chat"], "--chat needs --prompt TEXT"),
        (["--chat", "--prompt", "hi", "--ignore-eos"], "--ignore-eos is for plain sampling"),
        (["--chat", "--interactive", "--prompt", "hi"], "--prompt with --interactive"),
    ],
)
def test_chat_flag_misuse_is_one_line(scripted, capsys, args, needle):
    assert main(["sample", str(scripted[0]), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err
