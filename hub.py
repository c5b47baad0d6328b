"""Models and datasets by Hugging Face hub name (`org/name`, or `org/name@revision` pinned to a branch, tag or
commit): their snapshot in the local cache ($HF_HOME, $HF_HUB_CACHE), downloaded first where missing, once per node
under torchrun. Offline ($HF_HUB_OFFLINE=1) only the cache answers, and a name not in it is refused before anything
loads."""
import os
import re
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from huggingface_hub import constants as hub_constants
from huggingface_hub import snapshot_download
from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

LOCAL = {"model": "model folder", "dataset": "file"}  # what a name that is not on the hub must be instead


def hub_name(path: str) -> tuple[str, str | None] | None:
    """(repo id, revision) of a Hugging Face hub name, `org/name` or `org/name@revision` (a branch, tag or commit);
    None for what can only be a local path (an existing one, or one that starts with / . ~ or has more parts)."""
    if Path(path).exists() or path.startswith(("/", ".", "~")):
        return None
    match = re.fullmatch(r"([\w.-]+(?:/[\w.-]+)?)(?:@([\w./-]+))?", path)
    return (match.group(1), match.group(2)) if match else None


def cached(repo: str, revision: str | None, kind: str = "model") -> str | None:
    """The complete snapshot of a hub `kind` ("model" or "dataset") in the local cache, or None."""
    try:
        return snapshot_download(repo, revision=revision, repo_type=kind, local_files_only=True)
    except Exception:  # not cached, or cached in part: huggingface_hub raises several types for both
        return None


def check_cached(path: str, where: str, kind: str = "model") -> None:
    """Offline ($HF_HUB_OFFLINE=1), refuse the hub name `path` when its snapshot is not in the local cache, in one
    message starting with `where` (the flag and the name). Online, the download comes later (`fetch`)."""
    repo, revision = hub_name(path)
    if hub_constants.HF_HUB_OFFLINE and cached(repo, revision, kind) is None:
        raise ValueError(f"{where}: no such {LOCAL[kind]}, nor a Hugging Face {kind} in the local cache "
                         f"({hub_constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE=1 forbids downloading it: fetch it "
                         f"first (`{download_command(repo, revision, kind)}`) or unset HF_HUB_OFFLINE")


def download_command(repo: str, revision: str | None, kind: str) -> str:
    return (f"hf download {repo}" + (" --repo-type dataset" if kind == "dataset" else "")
            + (f" --revision {revision}" if revision else ""))


def fetch(path: str, flag: str | None = None, kind: str = "model") -> str:
    """The local folder of `path`: the path itself, or for a hub name (`org/name[@revision]`) of a `kind` ("model" or
    "dataset") its snapshot in the Hugging Face cache ($HF_HOME), downloaded first if missing. Collective under
    torchrun: local rank 0 of each node downloads (huggingface_hub: files already complete are kept, a dropped
    connection resumes where it broke) while the other ranks wait for it, at most $KILN_DOWNLOAD_TIMEOUT_S seconds
    (default 4 hours); then every rank takes the same local folder. A download that fails stops every rank with one
    message naming `flag` (the setting that named it, if any) and `path`."""
    hub = hub_name(path)
    if hub is None:
        return path
    repo, revision = hub
    where = f"{flag} {path}" if flag else path
    check_cached(path, where, kind)  # offline: the cache or one line now, on every rank alike
    timeout_s = float(os.environ.get("KILN_DOWNLOAD_TIMEOUT_S", 4 * 3600))
    waiting = (dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))  # before the download: its own
               if dist.is_initialized() and dist.get_world_size() > 1 else None)  # timeout, not the job's
    error = None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and cached(repo, revision, kind) is None:
        print(f"{where}: downloading from {hub_constants.ENDPOINT} into {hub_constants.HF_HUB_CACHE}", flush=True)
        try:
            snapshot_download(repo, revision=revision, repo_type=kind)
        except RepositoryNotFoundError:
            error = (f"{where}: no such {kind} on {hub_constants.ENDPOINT} (or it is private or gated: log in "
                     "with `hf auth login`)")
        except RevisionNotFoundError:
            error = f"{where}: the {kind} has no revision {revision!r} on {hub_constants.ENDPOINT}"
        except Exception as e:  # offline, unreachable, disk full, ...: the library's first line says which
            error = f"{where}: could not download it ({type(e).__name__}: {str(e).strip().splitlines()[0]})"
    errors = [error]
    if waiting is not None:
        errors = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(errors, error, group=waiting)
        except RuntimeError as e:
            raise RuntimeError(f"{where}: rank {dist.get_rank()} waited {timeout_s:.0f} s for local rank 0 of its "
                               "node to download it; set KILN_DOWNLOAD_TIMEOUT_S higher, or fetch it first "
                               f"(`{download_command(repo, revision, kind)}`)") from e
        dist.destroy_process_group(waiting)
    if any(errors):
        raise RuntimeError(next(e for e in errors if e))
    local = cached(repo, revision, kind)
    if local is None:
        raise RuntimeError(f"{where}: downloaded, yet not found in this rank's cache {hub_constants.HF_HUB_CACHE}")
    return local
