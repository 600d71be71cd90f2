"""The private torch names that gptcore relies on, each behind one function (the fence: see
`gptcore.fence`; `gptrun doctor` checks every entry of `FENCED`). Checked against the source of
torch 2.13.0; after an upgrade, check each against the new source and run the test named.

One family is called where it is used instead: the `torch._foreach_*` ops of the AdamW step
(`gptcore.optim`), the ones torch.optim's own foreach AdamW is made of. The optimizer step should
read as the update it is, so they are listed here for `gptrun doctor` to check, not wrapped."""

from __future__ import annotations

from gptcore.fence import Private, require

INDUCTOR_CACHE = Private(
    "torch._inductor.runtime.cache_dir_utils",
    "default_cache_dir",
    "torch 2.13.0",
    "tests/test_compile.py::test_compile_cache_is_shared_in_gptruns_cache",
)
FOREACH = [
    Private(
        "torch",
        f"_foreach_{op}_",
        "torch 2.13.0",
        "tests/test_optim.py::test_matches_torch_adamw_including_a_state_dict_round_trip",
    )
    for op in ("add", "mul", "lerp", "addcmul", "addcdiv", "div")
]
FENCED = [INDUCTOR_CACHE, *FOREACH]


def inductor_default_cache_dir() -> str:
    """The per-user folder in /tmp that importing torch._dynamo puts in TORCHINDUCTOR_CACHE_DIR
    when the user chose none."""
    require(INDUCTOR_CACHE)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()
