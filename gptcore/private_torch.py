"""The private torch names that gptcore relies on, each behind one function (the fence: see
`gptcore.fence`; `gptrun doctor` checks every entry of `FENCED`). Checked against the source of
torch 2.13.0; after an upgrade, check each against the new source and run the test named."""

from __future__ import annotations

from gptcore.fence import Private, require

INDUCTOR_CACHE = Private(
    "torch._inductor.runtime.cache_dir_utils",
    "default_cache_dir",
    "torch 2.13.0",
    "tests/test_compile.py::test_compile_cache_is_shared_in_gptruns_cache",
)
FENCED = [INDUCTOR_CACHE]


def inductor_default_cache_dir() -> str:
    """The per-user folder in /tmp that importing torch._dynamo puts in TORCHINDUCTOR_CACHE_DIR
    when the user chose none."""
    require(INDUCTOR_CACHE)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()
