"""Publish a packed output folder to the Hugging Face Hub as a dataset repo.

``push(folder, repo_id)`` is what ``packprep push`` and ``packprep pack --push-to`` run:

1. ``verify(folder)`` (with shard hashes); a folder that fails it is refused (``VerifyError``); a
   folder exported to a stack's own format is checked for its files only (its source was verified);
2. resolve the token (``token=``, else ``HF_TOKEN``, else ``hf auth login``) and ask the Hub who it
   belongs to, so a missing or invalid token fails before anything is sent;
3. create the dataset repo if it does not exist (``private`` only applies then);
4. list the files already on the Hub at ``revision`` and compare them with the local ones (LFS
   sha256 for shards, git blob id for small files): unchanged files are not sent again;
5. commit what changed through ``HfApi.create_commit``: one commit when the changed files fit in
   ``MAX_COMMIT_BYTES`` / ``MAX_COMMIT_FILES``; otherwise the shards go in several commits and the
   card, manifest and rejects come in the last one, so the repo's ``packprep.json`` only ever
   describes shards that are all there. An interrupted push is resumed by running it again:
   whatever was committed is skipped.

What is pushed: ``README.md``, ``packprep.json``, ``rejects.jsonl`` (if any; with local paths cut to
their names, see :func:`published`) and every file under ``data/`` (shards, plus
``state.json``/``dataset_info.json`` for Arrow output). Remote files under ``data/`` that the local folder no longer has (shards of an earlier, differently sharded push) and a
remote ``rejects.jsonl`` the folder no longer has are deleted in the last commit, so the card's
``data/train-*`` pattern never mixes two runs. Other remote files (a LICENSE, ``.gitattributes``)
are left alone.

``revision`` must name an existing branch: a typo must not silently create a new branch. Create one
with ``hf repos branch create REPO BRANCH --repo-type dataset``.

Every failure a user can meet is a :class:`~packprep.errors.PushError` with one clear line: no
token, an invalid token, a repo in a namespace the token cannot write to, no network (or
``HF_HUB_OFFLINE`` set), a branch that does not exist.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from . import __version__
from .errors import ConfigError, PushError, VerifyError, UnreadableLayout

# One commit holds at most this much new data; larger pushes are split (see module docstring).
MAX_COMMIT_BYTES = 10 * 1024**3
MAX_COMMIT_FILES = 50
REPO_TYPE = "dataset"
DEFAULT_BRANCH = "main"
LOGIN_HINT = "pass --token, set HF_TOKEN, or run `hf auth login`"


class PushResult(str):
    """The URL of the last commit (or of the current head when nothing changed), plus what happened."""

    repo_id: str
    repo_url: str
    revision: str
    commits: list
    uploaded: list
    unchanged: list
    deleted: list


@dataclass
class _LocalFile:
    path: str  # in the repo, posix
    local: Path
    size: int
    sha256: str | None = None  # known from the (verified) manifest for shards
    content: bytes | None = None  # what is published instead of the file's bytes (see ``published``)

    def digest(self) -> str:
        if self.sha256 is None:
            self.sha256 = (hashlib.sha256(self.content).hexdigest() if self.content is not None
                           else _file_hash(self.local, hashlib.sha256()))
        return self.sha256

    def git_blob_id(self) -> str:
        sha1 = hashlib.sha1(b"blob %d\0" % self.size)
        if self.content is not None:
            sha1.update(self.content)
            return sha1.hexdigest()
        return _file_hash(self.local, sha1)


def published(folder: Path, name: str, manifest: dict) -> bytes:
    """The bytes pushed for a small file (card, manifest, rejects): each local input or tokenizer
    path that is absolute or leaves the working folder (``/home/me/...``, ``~/...``, ``../...``) is
    cut to its last part. The folder keeps them as the user named them; the packer's disk is not
    published."""
    data = (folder / name).read_bytes()
    for local, public in _private_paths(manifest):
        for form in dict.fromkeys((local, json.dumps(local)[1:-1])):  # as written, and inside JSON strings
            data = data.replace(form.encode(), public.encode())
    return data


def _private_paths(manifest: dict) -> list[tuple[str, str]]:
    paths = set()
    for source in manifest.get("inputs", []):
        if source.get("kind") != "hub":
            paths.update(p for p in (source.get("path"), source.get("named")) if isinstance(p, str))
    tokenizer = manifest.get("tokenizer", {})
    if tokenizer.get("kind") != "hub" and isinstance(tokenizer.get("name_or_path"), str):
        paths.add(tokenizer["name_or_path"])
    private = [p for p in paths if os.path.isabs(p) or p.startswith(("~", "..")) or "\\" in p]
    # longest first: a folder's path must not be cut inside a file path that starts with it
    return [(p, p.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1] or p) for p in sorted(private, key=len, reverse=True)]


def _file_hash(path: Path, hasher) -> str:
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            hasher.update(block)
    return hasher.hexdigest()


def push(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    commit_message: str | None = None,
) -> PushResult:
    """Verify ``folder`` and upload it to the dataset repo ``repo_id``; return the commit URL."""
    _check_repo_id(repo_id)
    folder = Path(folder)
    _refuse_unverified(folder)
    manifest = json.loads((folder / "packprep.json").read_text())
    local = _local_files(folder, manifest)

    api, endpoint = _client(token)
    user = _whoami(api, endpoint)
    if "/" not in repo_id:
        repo_id = f"{user}/{repo_id}"
    branch = revision or DEFAULT_BRANCH
    message = commit_message or (
        f"packprep {__version__}: {manifest['rows']:,} rows, {manifest['tokens']['total']:,} tokens "
        f"({manifest['config']['strategy']}, max_len {manifest['config']['max_len']})"
    )

    done: list[str] = []
    with _translate(endpoint, repo_id, user, branch, done):
        if not _repo_exists(api, repo_id):
            if revision not in (None, DEFAULT_BRANCH):
                raise PushError(
                    f"branch {revision!r} does not exist: dataset {repo_id} does not exist yet. Push to main "
                    f"first, then create the branch (hf repos branch create {repo_id} {revision} --repo-type dataset)"
                )
            api.create_repo(repo_id, repo_type=REPO_TYPE, private=private, exist_ok=True)
        changed, unchanged, deleted = _diff(api, repo_id, revision, local)
        batches = _plan(changed, deleted)
        xet = _xet_served(api, endpoint, repo_id, branch)
        for number, (adds, deletes) in enumerate(batches, start=1):
            operations = [_add_operation(item) for item in adds] + [_delete_operation(path) for path in deletes]
            suffix = f" (part {number}/{len(batches)})" if len(batches) > 1 else ""
            with _xet_off_unless(xet):
                info = api.create_commit(
                    repo_id, operations, commit_message=message + suffix, repo_type=REPO_TYPE, revision=revision,
                    num_threads=8,
                )
            done.append(info.commit_url)
        if done:
            url = done[-1]
        else:
            head = api.repo_info(repo_id, repo_type=REPO_TYPE, revision=revision).sha
            url = f"{endpoint}/datasets/{repo_id}/commit/{head}"

    result = PushResult(url)
    result.repo_id = repo_id
    result.repo_url = f"{endpoint}/datasets/{repo_id}" + (f"/tree/{revision}" if revision else "")
    result.revision = branch
    result.commits = done
    result.uploaded = [item.path for item in changed]
    result.unchanged = [item.path for item in unchanged]
    result.deleted = deleted
    return result


def _refuse_unverified(folder: Path) -> None:
    """Raise VerifyError unless ``folder`` passes verify: a broken folder is never pushed."""
    from .verification import verify

    # a stack's own layout (padded rows, other files) cannot be read back; its source was verified
    # when it was exported, and verify still checks its files against the manifest
    try:
        failures = [failure for failure in verify(folder).failures if failure.check != "layout"]
    except UnreadableLayout:  # raised only once its files matched the manifest
        failures = []
    if failures:
        shown = "\n  ".join(str(failure) for failure in failures[:10])
        more = f"\n  ... and {len(failures) - 10} more" if len(failures) > 10 else ""
        raise VerifyError(f"{folder} fails verification, so it is not pushed; pack it again:\n  {shown}{more}")


def _diff(api, repo_id: str, revision: str | None, local: list) -> tuple[list, list, list[str]]:
    """The local files that differ from the repo's, those that match, and the repo's stale data files."""
    remote = {
        entry.path: entry
        for entry in api.list_repo_tree(repo_id, repo_type=REPO_TYPE, revision=revision, recursive=True)
        if hasattr(entry, "blob_id")  # files, not folders
    }
    changed, unchanged = [], []
    for item in local:
        (unchanged if _same(item, remote.get(item.path)) else changed).append(item)
    local_paths = {item.path for item in local}
    deleted = sorted(
        path for path in remote
        if path not in local_paths and (path.startswith("data/") or path == "rejects.jsonl")
    )
    return changed, unchanged, deleted


def check_credentials(token: str | None = None) -> str:
    """Fail fast, before a long ``pack``, if a push could not authenticate; return the user name."""
    api, endpoint = _client(token)
    return _whoami(api, endpoint)


# ---------------------------------------------------------------------- steps


def _local_files(folder: Path, manifest: dict) -> list[_LocalFile]:
    shard_sha = {shard["path"]: shard["sha256"] for shard in manifest["shards"]}
    files = []
    for name in ("README.md", "packprep.json", "rejects.jsonl"):
        if (folder / name).is_file():
            content = published(folder, name, manifest)
            files.append(_LocalFile(name, folder / name, len(content), content=content))
    data = folder / "data"
    for path in sorted(data.rglob("*")) if data.is_dir() else []:
        if path.is_file() and not any(part.startswith(".") for part in path.relative_to(folder).parts):
            name = path.relative_to(folder).as_posix()
            files.append(_LocalFile(name, path, path.stat().st_size, shard_sha.get(name)))
    return files


def _same(item: _LocalFile, remote) -> bool:
    """Is the remote file (a RepoFile, or None) byte-identical to the local one?"""
    if remote is None or remote.size != item.size:
        return False
    lfs = getattr(remote, "lfs", None)
    if lfs is not None:
        sha256 = lfs["sha256"] if isinstance(lfs, dict) else lfs.sha256
        return sha256 == item.digest()
    return remote.blob_id == item.git_blob_id()


def _plan(changed: list[_LocalFile], deleted: list[str]) -> list[tuple[list[_LocalFile], list[str]]]:
    """Commits to make: shards in batches, then the card/manifest/rejects and deletions last."""
    shards = [item for item in changed if item.path.startswith("data/")]
    rest = [item for item in changed if not item.path.startswith("data/")]
    if not changed and not deleted:
        return []
    if sum(item.size for item in changed) <= MAX_COMMIT_BYTES and len(changed) <= MAX_COMMIT_FILES:
        return [(shards + rest, deleted)]
    batches: list[list[_LocalFile]] = [[]]
    size = 0
    for item in shards:
        if batches[-1] and (size + item.size > MAX_COMMIT_BYTES or len(batches[-1]) >= MAX_COMMIT_FILES):
            batches.append([])
            size = 0
        batches[-1].append(item)
        size += item.size
    plan = [(batch, []) for batch in batches if batch]
    if rest or deleted:
        plan.append((rest, deleted))
    return plan


def _add_operation(item: _LocalFile):
    from huggingface_hub import CommitOperationAdd

    operation = CommitOperationAdd(path_in_repo=item.path,
                                   path_or_fileobj=item.content if item.content is not None else str(item.local))
    if item.sha256 is not None:  # already verified: spare the client a second read of the shard
        with contextlib.suppress(AttributeError):
            operation.upload_info.sha256 = bytes.fromhex(item.sha256)
    return operation


def _delete_operation(path: str):
    from huggingface_hub import CommitOperationDelete

    return CommitOperationDelete(path_in_repo=path)


def _check_repo_id(repo_id: str) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ConfigError(f"{repo_id!r} is not a Hub repo id (NAME or NAMESPACE/NAME): {exc}") from exc


def _repo_exists(api, repo_id: str) -> bool:
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        api.repo_info(repo_id, repo_type=REPO_TYPE)
        return True
    except RepositoryNotFoundError:
        return False


# ---------------------------------------------------------------------- client and errors


def _client(token: str | None):
    from huggingface_hub import HfApi, constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise PushError("HF_HUB_OFFLINE is set, so the Hub cannot be reached; unset it to push")
    token = token or get_token()
    if not token:
        raise PushError(f"no Hugging Face token: {LOGIN_HINT} (a token with write access)")
    endpoint = (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    api = HfApi(endpoint=endpoint, token=token, library_name="packprep", library_version=__version__)
    return api, endpoint


def _xet_served(api, endpoint: str, repo_id: str, branch: str) -> bool:
    """Whether the server at ``endpoint`` takes Xet uploads: huggingface_hub uploads through Xet whenever
    hf_xet is installed, and a server without it (a self-hosted or stand-in Hub, HF_ENDPOINT) answers its
    token request with 404; the plain HTTP (LFS) upload then goes there, with no HF_HUB_DISABLE_XET to set."""
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers, get_session

    if constants.HF_HUB_DISABLE_XET:
        return False
    url = f"{endpoint}/api/{REPO_TYPE}s/{repo_id}/xet-write-token/{branch}"
    try:
        answer = get_session().get(url, headers=build_hf_headers(token=api.token))
    except Exception:  # unreachable now: the upload itself says why, as before
        return True
    return answer.status_code != 404


@contextlib.contextmanager
def _xet_off_unless(xet: bool):
    from huggingface_hub import constants

    before = constants.HF_HUB_DISABLE_XET
    constants.HF_HUB_DISABLE_XET = before or not xet
    try:
        yield
    finally:
        constants.HF_HUB_DISABLE_XET = before


def _whoami(api, endpoint: str) -> str:
    with _translate(endpoint, None, None, None, []):
        return api.whoami()["name"]


def _network_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                          ("requests", ("ConnectionError", "Timeout"))):
        with contextlib.suppress(ImportError):
            imported = __import__(module)
            errors.extend(getattr(imported, name) for name in names if hasattr(imported, name))
    return tuple(errors)


@contextlib.contextmanager
def _translate(endpoint: str, repo_id: str | None, user: str | None, branch: str | None, done: list[str]):
    """Turn the client's exceptions (or the ones they wrap) into one-line PushErrors."""
    try:
        yield
    except PushError:
        raise
    except Exception as exc:
        error = _explain(exc, endpoint, repo_id, user, branch)
        if error is None:
            raise
        if done:
            error = PushError(
                f"{error} ({len(done)} commit(s) were made before this; run the same push again to finish: "
                "files already on the Hub are not sent again)"
            )
        raise error from exc


def _explain(exc: BaseException, endpoint, repo_id, user, branch) -> PushError | None:
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalTokenNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    seen = set()
    while exc is not None and id(exc) not in seen:  # the client wraps upload errors in RuntimeError
        seen.add(id(exc))
        if isinstance(exc, LocalTokenNotFoundError):
            return PushError(f"no Hugging Face token: {LOGIN_HINT}")
        if isinstance(exc, RevisionNotFoundError):
            return PushError(
                f"branch {branch!r} does not exist in dataset {repo_id}; create it first "
                f"(hf repos branch create {repo_id} {branch} --repo-type dataset) or push without --revision"
            )
        if isinstance(exc, HfHubHTTPError):
            response = getattr(exc, "response", None)
            status = getattr(response, "status_code", None)
            server = (getattr(exc, "server_message", None) or "").strip().replace("\n", " ")
            hub_says = f" (Hub: {server})" if server else ""
            if status == 401 and not isinstance(exc, RepositoryNotFoundError):
                return PushError(f"the Hub at {endpoint} rejected the token (401: invalid credentials); {LOGIN_HINT} "
                                 "with a valid token")
            if status == 403:
                namespace, name = (repo_id.split("/", 1) if repo_id and "/" in repo_id else ("?", repo_id))
                if namespace == user:
                    return PushError(
                        f"the token of {user!r} has no write permission on dataset {repo_id} (403 forbidden); use a "
                        f"token with write access (https://huggingface.co/settings/tokens){hub_says}"
                    )
                return PushError(
                    f"the token of {user!r} may not write to dataset {repo_id}, which belongs to {namespace!r} "
                    f"(403 forbidden). Push to {user}/{name} instead, or ask {namespace!r} for write access{hub_says}"
                )
            if isinstance(exc, RepositoryNotFoundError):
                return PushError(f"dataset {repo_id} cannot be found or read with the token of {user!r}{hub_says}")
            return PushError(f"the Hub refused the push ({status}): {server or exc}")
        if isinstance(exc, _network_errors()):
            return PushError(
                f"cannot reach the Hub at {endpoint}: {exc or type(exc).__name__}. Check the network connection "
                "(and HF_ENDPOINT, if set)"
            )
        if isinstance(exc, ValueError) and "README.md" in str(exc):  # the client's card metadata check
            return PushError(f"the Hub refused the dataset card: {exc}")
        exc = exc.__cause__ or exc.__context__
    return None
