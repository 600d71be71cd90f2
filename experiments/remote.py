"""Experiments in object storage (`s3://bucket/prefix/NAME`, `gs://...`), through pyarrow.fs.

Where no folder is shared by every node (Kubernetes without a ReadWriteMany volume), a sweep keeps
its state under a URI: Ray Tune writes its experiment state, the trials' results and checkpoints
there itself (through pyarrow.fs), and gptrun's own files (`gptrun.toml`, `sweep.json`,
`events.jsonl`, `best.toml`, `noise.json`) are uploaded there as they are written.

The driver works on a local copy of those small files: the working copy, a folder in gptrun's
cache named after the URI (`$GPTRUN_CACHE_DIR/remote/s3/bucket/prefix/NAME`), whose
`.gptrun-remote` file holds the URI. Every reader and writer of an experiment folder works on it
unchanged; `location` gives Tune the URI instead. The Optuna study's sqlite file stays in the
working copy, next to the driver: sqlite cannot live in an object store, and a study served
from elsewhere is what `sweep.storage_url` (PostgreSQL) is for, which a sweep resumed from
another machine needs.

A missing bucket, refused credentials or an unreachable endpoint are one line before Ray starts
(`check_bucket`).
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

from gptcore.errors import UserError, first_line

MARKER = ".gptrun-remote"
CHECK_TIMEOUT_S = 30.0  # the probe's outer bound; its own bounds (`_bounded`) end it sooner
# gptrun's own files of an experiment (and of its confirm run): what a working copy pulls.
OWN_FILES = ("gptrun.toml", "sweep.json", "events.jsonl", "best.toml", "noise.json")
SCHEMES = {"gcs": "gs"}  # pyarrow's filesystem type name -> the URI scheme users write
URI_SCHEMES = ("s3", "gs", "gcs", "file")  # what `filesystem` opens (gs:// and gcs:// alike)


def is_uri(location: str | Path) -> bool:
    text = str(location)
    return "://" in text and not text.startswith("file://")


def filesystem(uri: str) -> tuple[Any, str]:
    """(pyarrow filesystem, path inside it) of `uri`, or one line when pyarrow cannot open it or
    its scheme is not one gptrun is tested with (S3 and GCS, whose errors `_storage_error` names;
    pyarrow's Azure client aborted the process, with no error to catch, where it found no
    credentials)."""
    import pyarrow.fs

    scheme = uri.partition("://")[0].lower()
    if scheme not in URI_SCHEMES:
        raise UserError(
            f"{uri}: gptrun keeps experiments in s3:// or gs:// object storage, not {scheme}://; "
            "give one of those, or a folder (on a cluster, one that every node mounts)"
        )
    try:
        return pyarrow.fs.FileSystem.from_uri(uri)
    except Exception as err:  # ArrowInvalid / OSError: an unknown scheme, a malformed URI
        raise UserError(f"{uri}: {first_line(err, 300)}") from None


def check_bucket(uri: str) -> None:
    """One line, before Ray starts, when the bucket of `uri` does not exist, the credentials are
    missing or refused, or the endpoint does not answer. The probe runs on a copy of the
    filesystem with its own bounds (`_bounded`): unbounded, a gs:// probe without credentials
    retries for minutes. A daemon thread holds it, so that nothing waits for it at exit (an
    executor's thread is joined there) and Ctrl-C ends the wait."""
    import pyarrow.fs

    fs, path = filesystem(uri)
    bucket = path.split("/", 1)[0]
    scheme = SCHEMES.get(fs.type_name, fs.type_name)
    outcome: list[Any] = []
    probe = threading.Thread(target=_probe, args=(_bounded(fs), bucket, outcome), daemon=True)
    probe.start()
    probe.join(CHECK_TIMEOUT_S)
    if not outcome:
        raise UserError(
            f"{uri}: the object store did not answer within {CHECK_TIMEOUT_S:g}s; {_fixes(scheme)}"
        )
    (result,) = outcome
    if isinstance(result, OSError):
        raise UserError(f"{uri}: {_storage_error(result, scheme)}")
    if result.type == pyarrow.fs.FileType.NotFound:
        raise UserError(f"{uri}: bucket {bucket!r} does not exist; create it first or fix the URI")


BOUNDED_TIMEOUT_S = 8.0  # each S3 connect and request; GCS's retries in all
BOUNDED_ATTEMPTS = 2  # S3 requests, the first included


def _bounded(fs: Any) -> Any:
    """`fs` with the same options and bounded waits: S3's connect and request timeouts and
    attempts, GCS's retry time limit (for the bucket probe, and the uploads made from Tune's
    callbacks). Other filesystems as they are."""
    import datetime

    import pyarrow.fs

    rebuild, (options,) = fs.__reduce__()
    if fs.type_name == "s3":
        options.update(connect_timeout=BOUNDED_TIMEOUT_S, request_timeout=BOUNDED_TIMEOUT_S)
        options["retry_strategy"] = pyarrow.fs.AwsStandardS3RetryStrategy(max_attempts=BOUNDED_ATTEMPTS)
    elif fs.type_name == "gcs":
        options["retry_time_limit"] = datetime.timedelta(seconds=BOUNDED_TIMEOUT_S)
    else:
        return fs
    return rebuild(options)


def _probe(fs: Any, bucket: str, outcome: list[Any]) -> None:
    try:
        outcome.append(fs.get_file_info(bucket))
    except OSError as err:
        outcome.append(err)


def _fixes(scheme: str) -> str:
    if scheme == "gs":
        return (
            "check the network and the credentials (GOOGLE_APPLICATION_CREDENTIALS, or "
            "`gcloud auth application-default login`)"
        )
    return "check the endpoint (AWS_ENDPOINT_URL) and the network"


def _storage_error(err: OSError, scheme: str) -> str:
    text = first_line(err, 300)
    lower = text.lower()
    if scheme == "gs":
        if any(k in lower for k in ("oauth2", "credential", "access token", "permission", "403", "401")):
            return (
                f"no usable Google credentials ({text}); set GOOGLE_APPLICATION_CREDENTIALS to a "
                "service-account key file, or run `gcloud auth application-default login`"
            )
        return f"{text}; {_fixes(scheme)}"
    if any(k in lower for k in ("access_denied", "accessdenied", "403", "invalidaccesskeyid", "signature")):
        return f"access refused ({text}); check the credentials (AWS_ACCESS_KEY_ID / a profile / the role)"
    if "credential" in lower:
        return f"no credentials ({text}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or a profile"
    if any(k in lower for k in ("network_connection", "connect", "resolve", "timeout")):
        return f"cannot reach the object store ({text}); check the endpoint (AWS_ENDPOINT_URL)"
    return text


def working_copy(uri: str) -> Path:
    """The local folder that stands for experiment `uri` on this machine (in gptrun's cache)."""
    from gptcore.data import cache_dir

    fs, path = filesystem(uri)
    scheme = SCHEMES.get(fs.type_name, fs.type_name)
    return cache_dir() / "remote" / scheme / path.strip("/")


def location(folder: Path) -> str:
    """Where Ray Tune keeps `folder`: its URI for a working copy (or a folder inside one, such
    as `confirm/`), else the absolute local path."""
    folder = folder.resolve()
    for parent in (folder, *folder.parents):
        marker = parent / MARKER
        if marker.is_file():
            rest = folder.relative_to(parent).as_posix()
            uri = marker.read_text().strip()
            return uri if rest == "." else f"{uri}/{rest}"
    return str(folder)


def open_working_copy(uri: str, *, pull: bool) -> Path:
    """The working copy of experiment `uri`, made if missing, with gptrun's own files fetched from
    the URI (`pull`) so that it shows the experiment as the object store holds it."""
    uri = uri.rstrip("/")
    folder = working_copy(uri)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).write_text(uri + "\n")
    if pull:
        for sub in ("", "confirm/"):
            for name in OWN_FILES:
                if name == APPEND_ONLY and _holds_more(folder / sub / name, f"{uri}/{sub}{name}"):
                    continue
                download(f"{uri}/{sub}{name}", folder / sub / name)
    return folder


def _holds_more(local: Path, uri: str) -> bool:
    """Whether `local` holds what `uri` holds and more lines after it: the batch a killed driver
    wrote here but had not uploaded yet, which a download would lose."""
    remote = read_text(uri)
    return local.is_file() and remote is not None and local.read_text(encoding="utf-8").startswith(remote)


def download(uri: str, dest: Path) -> bool:
    """Copy one object to `dest` (whole or not at all); False when there is none."""
    import pyarrow.fs

    from gptcore.atomic import atomic_file

    fs, path = filesystem(uri)
    if fs.get_file_info(path).type != pyarrow.fs.FileType.File:
        dest.unlink(missing_ok=True)  # gone from the store: not in the copy either
        return False
    with atomic_file(dest) as tmp, fs.open_input_stream(path) as src, open(tmp, "wb") as out:
        shutil.copyfileobj(src, out)
    return True


def read_text(uri: str) -> str | None:
    """The text of one object, None when there is none."""
    import pyarrow.fs

    fs, path = filesystem(uri)
    if fs.get_file_info(path).type != pyarrow.fs.FileType.File:
        return None
    with fs.open_input_stream(path) as src:
        return src.read().decode("utf-8")


def upload(folder: Path, name: str, *, bounded: bool = False) -> None:
    """Copy `folder/name` to the experiment's URI when `folder` is (inside) a working copy;
    `bounded`: through the filesystem with short timeouts and few attempts (`_bounded`)."""
    target = location(folder)
    if not is_uri(target):
        return
    fs, path = filesystem(f"{target}/{name}")
    if bounded:
        fs = _bounded(fs)
    with open(folder / name, "rb") as src, fs.open_output_stream(path) as out:
        shutil.copyfileobj(src, out)


APPEND_ONLY = "events.jsonl"  # grows by lines: uploaded in batches, merged on a pull
BATCH_S = 5.0  # an append-only file is uploaded at most this often (and at the sweep's end)
RETRY_S = 60.0  # after a failed upload, the next try waits this long
_next_upload: dict[Path, float] = {}  # file -> when this process may upload it again


def upload_soon(folder: Path, name: str, *, now: bool = False) -> None:
    """Upload a file that grows by appends (`events.jsonl`), at most every `BATCH_S` seconds
    unless `now`: an object store has no append, so each upload is the whole file, and one per
    event made the traffic grow with the square of the events. It runs in a Tune callback, on
    the driver's loop, so it is bounded (`_bounded`: an endpoint that stopped answering held
    each event for 99 s) and a failure is one warning, tried again `RETRY_S` later with every
    line written since; it never ends the sweep (the local copy has every line)."""
    import time

    path = folder / name
    if not path.exists():  # nothing written yet
        return
    if not now and time.monotonic() < _next_upload.get(path, float("-inf")):
        return
    wait = BATCH_S
    try:
        upload(folder, name, bounded=True)
    except (OSError, UserError) as err:
        print(f"warning: {name} not uploaded ({first_line(err, 300)}); trying again later", flush=True)
        wait = RETRY_S
    _next_upload[path] = time.monotonic() + wait


def open_location(where: str) -> tuple[Any, str]:
    """(pyarrow filesystem, path inside it) of a folder or URI."""
    import pyarrow.fs

    return filesystem(where) if is_uri(where) else (pyarrow.fs.LocalFileSystem(), where)


def has_tune_state(where: str) -> bool:
    """Whether Tune has saved an experiment state in folder or URI `where`."""
    import pyarrow.fs

    fs, path = open_location(where)
    found = fs.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True))
    return any(Path(f.path).name.startswith("experiment_state-") for f in found)


def exists(uri: str) -> bool:
    """Whether anything is stored under `uri`: an object, or a folder that holds one (an empty
    folder marker, which pyarrow writes where it deletes a folder's last object, is nothing)."""
    import pyarrow.fs

    fs, path = filesystem(uri)
    kind = fs.get_file_info(path).type
    if kind == pyarrow.fs.FileType.Directory:
        return bool(fs.get_file_info(pyarrow.fs.FileSelector(path)))
    return kind != pyarrow.fs.FileType.NotFound


CLAIM_PREFIX = ".gptrun-claim-"  # one object per sweep that claimed the name (`claim`)


def claim(uri: str) -> bool:
    """Take the name `uri` for a new sweep: True for at most one of the sweeps that try at once.
    pyarrow.fs has no exclusive create (S3's If-None-Match, GCS's generation 0), so each
    claimant writes an object of its own under `uri` and then lists it: S3 and GCS list every
    object written before the listing began, so of two claimants the one that lists last sees
    both. Only one that finds nothing but its own object goes on; the others remove theirs and
    give way (two at the same moment may both give way; two never both go on). The winner's
    object stays: the name is taken from then on, as a local sweep's `mkdir` takes it. (A
    loser's delete leaves the empty folder marker pyarrow writes for a parent; `exists` looks
    past it.)"""
    import secrets

    import pyarrow.fs

    if exists(uri):  # taken long ago: nothing of ours is written there
        return False
    fs, path = filesystem(uri)
    mine = f"{path}/{CLAIM_PREFIX}{secrets.token_hex(8)}"
    with fs.open_output_stream(mine):
        pass
    found = fs.get_file_info(pyarrow.fs.FileSelector(path))
    if [f.path for f in found] == [mine]:
        return True
    fs.delete_file(mine)
    return False


def delete(uri: str) -> None:
    """Everything under `uri` (an experiment that --restart replaces)."""
    import pyarrow.fs

    fs, path = filesystem(uri)
    info = fs.get_file_info(path)
    if info.type == pyarrow.fs.FileType.Directory:
        fs.delete_dir(path)
    elif info.type == pyarrow.fs.FileType.File:
        fs.delete_file(path)


def shown_path(path: str, fs: Any) -> str:
    """A path inside `fs` as a user writes it: with its scheme for object stores."""
    if fs is None or fs.type_name == "local":
        return path
    return f"{SCHEMES.get(fs.type_name, fs.type_name)}://{path}"
