"""A small stand-in for the Hugging Face Hub, on loopback, for the push tests.

It implements the endpoints that the real ``huggingface_hub`` client (``HfApi``) calls to push a
folder, with the same URLs, payloads and error headers, and keeps what it receives so a test can
compare bytes:

* ``GET  /api/whoami-v2``                                       who the bearer token belongs to
* ``POST /api/repos/create``                                    create_repo (409 if it exists)
* ``GET  /api/{type}s/{id}[/revision/{rev}]``                   repo_info
* ``GET  /api/{type}s/{id}/tree/{rev}[/{path}]``                list_repo_tree (recursive)
* ``POST /api/{type}s/{id}/paths-info/{rev}``                   get_paths_info
* ``POST /api/validate-yaml``                                   README.md metadata check
* ``POST /api/{type}s/{id}/preupload/{rev}``                    upload mode (lfs/regular) + remote oid
* ``POST /{prefix}{id}.git/info/lfs/objects/batch``              LFS batch, *basic* transfer only
  (an object the server already holds gets no ``actions``, so the client does not send it again)
* ``PUT  /lfs-upload/{oid}``                                    the LFS upload href (same server)
* ``POST /api/{type}s/{id}/commit/{rev}``                       the NDJSON commit

Errors carry ``X-Error-Code`` / ``X-Error-Message`` the way the Hub sends them, so the client raises
the same exception classes (``RevisionNotFoundError``, ``RepositoryNotFoundError``, 401, 403 ...).

The client uploads through Xet when ``hf_xet`` is installed and the server takes it; this one does not
(404 at ``xet-write-token``), and ``packprep push`` then uploads through the plain HTTP LFS path.

Usage::

    with HubServer(tokens={"tok": "alice"}, orgs={"alice": ["team"]}) as hub:
        os.environ["HF_ENDPOINT"] = hub.url
        ...
        hub.files("alice/data")  # {path: bytes} at the head of main
        hub.uploads              # [sha256 of every LFS object PUT]
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

REPO_TYPES = ("model", "dataset", "space")
URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
LFS_SUFFIXES = (".parquet", ".arrow", ".bin", ".safetensors", ".zst", ".gz")
REGULAR_MAX = 10 * 1024 * 1024
GITATTRIBUTES = b"*.parquet filter=lfs diff=lfs merge=lfs -text\n*.arrow filter=lfs diff=lfs merge=lfs -text\n"


@dataclass
class Blob:
    size: int
    content: bytes | None = None  # regular file
    lfs: str | None = None  # sha256 of an LFS object held in HubServer.lfs

    @property
    def oid(self) -> str:  # what the tree API calls "oid": the git blob id
        data = self.content if self.lfs is None else _pointer(self.lfs, self.size)
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass
class Commit:
    oid: str
    parent: str | None
    message: str
    files: dict[str, Blob]


@dataclass
class Repo:
    repo_type: str
    repo_id: str
    private: bool
    branches: dict[str, str] = field(default_factory=dict)  # name -> commit oid
    commits: dict[str, Commit] = field(default_factory=dict)


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class HubServer:
    """A loopback Hub. ``tokens`` maps a bearer token to a user; ``orgs`` maps a user to orgs."""

    def __init__(self, tokens: dict[str, str] | None = None, orgs: dict[str, list[str]] | None = None):
        self.tokens = dict(tokens or {})
        self.orgs = {user: list(names) for user, names in (orgs or {}).items()}
        self.repos: dict[tuple[str, str], Repo] = {}
        self.lfs: dict[str, bytes] = {}  # sha256 -> content
        self.uploads: list[str] = []  # sha256 of every LFS PUT, in order
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request
        self.commits: list[tuple[str, str, list[str]]] = []  # (repo_id, revision, paths changed)
        self.fail_commits_after: int | None = None  # fail every commit once this many succeeded
        self._lock = threading.RLock()
        self._route = _make_route(self)
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "HubServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ for tests

    def add_repo(self, repo_id: str, repo_type: str = "dataset", private: bool = False,
                 files: dict[str, bytes] | None = None, branches: tuple[str, ...] = ()) -> Repo:
        """Make a repo directly (e.g. one owned by someone else)."""
        with self._lock:
            repo = Repo(repo_type, repo_id, private)
            self.repos[(repo_type, repo_id)] = repo
            initial = {".gitattributes": Blob(len(GITATTRIBUTES), GITATTRIBUTES)}
            for path, data in (files or {}).items():
                initial[path] = Blob(len(data), data)
            self._new_commit(repo, "main", None, "initial commit", initial)
            for branch in branches:
                repo.branches[branch] = repo.branches["main"]
            return repo

    def files(self, repo_id: str, revision: str = "main", repo_type: str = "dataset") -> dict[str, bytes]:
        """Every file at the head of ``revision``, LFS content resolved."""
        with self._lock:
            repo = self.repos[(repo_type, repo_id)]
            head = repo.commits[repo.branches[revision]]
            return {path: blob.content if blob.lfs is None else self.lfs[blob.lfs] for path, blob in head.files.items()}

    def commit_count(self, repo_id: str, revision: str = "main", repo_type: str = "dataset") -> int:
        with self._lock:
            repo = self.repos[(repo_type, repo_id)]
            oid, n = repo.branches[revision], 0
            while oid is not None:
                n, oid = n + 1, repo.commits[oid].parent
            return n

    # ------------------------------------------------------------------ internals

    def _new_commit(self, repo: Repo, branch: str, parent: str | None, message: str, files: dict[str, Blob]) -> Commit:
        seed = f"{repo.repo_id}\0{parent}\0{message}\0{time.time_ns()}\0{len(repo.commits)}"
        commit = Commit(hashlib.sha1(seed.encode()).hexdigest(), parent, message, files)
        repo.commits[commit.oid] = commit
        repo.branches[branch] = commit.oid
        return commit

    def user_of(self, headers) -> str | None:
        """The user of the bearer token; None without one; 401 for an unknown one."""
        auth = headers.get("Authorization") or ""
        if not auth:
            return None
        token = auth.removeprefix("Bearer ").strip()
        if token not in self.tokens:
            raise HubError(401, "Invalid credentials in Authorization header")
        return self.tokens[token]

    def can_write(self, user: str | None, repo_id: str) -> bool:
        namespace = repo_id.split("/")[0]
        return user is not None and (namespace == user or namespace in self.orgs.get(user, []))

    def repo(self, repo_type: str, repo_id: str, user: str | None, write: bool = False) -> Repo:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None or (repo.private and not self.can_write(user, repo_id)):
            raise HubError(404, "Repository not found", "RepoNotFound")
        if write and not self.can_write(user, repo_id):
            raise HubError(403, f"You don't have the rights to write to {repo_type}s/{repo_id}"
                           if user else "You must be authenticated to write to this repository")
        return repo

    def head(self, repo: Repo, revision: str) -> Commit:
        oid = repo.branches.get(revision) or (revision if revision in repo.commits else None)
        if oid is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return repo.commits[oid]


def _split_repo(rest: str) -> tuple[str, str]:
    """'ns/name/<tail>' -> ('ns/name', '<tail>')."""
    parts = rest.split("/", 2)
    if len(parts) < 2:
        raise HubError(404, "Not found")
    return "/".join(parts[:2]), parts[2] if len(parts) > 2 else ""


def _file_entry(path: str, blob: Blob) -> dict:
    entry = {"type": "file", "oid": blob.oid, "size": blob.size, "path": path}
    if blob.lfs is not None:
        entry["lfs"] = {"oid": blob.lfs, "size": blob.size, "pointerSize": len(_pointer(blob.lfs, blob.size))}
    return entry


def _handler(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        # ---------------------------------------------------------- plumbing

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        self.rfile.readline()
                        break
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                return b"".join(chunks)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _send(self, status: int, payload=None, headers: dict | None = None) -> None:
            data = b"" if payload is None else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def _dispatch(self, method: str) -> None:
            url = urlsplit(self.path)
            path, query = unquote(url.path), parse_qs(url.query)
            body = self._body()
            with hub._lock:
                hub.requests.append((method, url.path))
            try:
                with hub._lock:
                    status, payload = hub._route(method, path, query, body, self.headers)
                self._send(status, payload)
            except HubError as err:
                headers = {"X-Error-Message": err.message}
                if err.code:
                    headers["X-Error-Code"] = err.code
                self._send(err.status, {"error": err.message}, headers)
            except Exception as exc:  # a bug in this stand-in: say so instead of dropping the connection
                self._send(500, {"error": f"stand-in Hub crashed: {exc!r}"})

        def do_GET(self):
            self._dispatch("GET")

        def do_POST(self):
            self._dispatch("POST")

        def do_PUT(self):
            self._dispatch("PUT")

        def do_HEAD(self):
            self._dispatch("HEAD")

    return Handler


# ---------------------------------------------------------------------- routes


def _make_route(hub: HubServer):
    def route(method, path, query, body, headers):
        user = hub.user_of(headers)

        if method == "GET" and path == "/api/whoami-v2":
            if user is None:
                raise HubError(401, "Invalid credentials in Authorization header")
            orgs = [{"name": org, "type": "org"} for org in hub.orgs.get(user, [])]
            return 200, {"type": "user", "name": user, "orgs": orgs,
                         "auth": {"type": "access_token", "accessToken": {"role": "write"}}}

        if method == "POST" and path == "/api/validate-yaml":
            return 200, {"errors": [], "warnings": []}

        if method == "POST" and path == "/api/repos/create":
            if user is None:
                raise HubError(401, "Invalid credentials in Authorization header")
            payload = json.loads(body or b"{}")
            repo_type = payload.get("type") or "model"
            namespace = payload.get("organization") or user
            repo_id = f"{namespace}/{payload['name']}"
            if not hub.can_write(user, repo_id):
                raise HubError(403, f"You don't have the rights to create a {repo_type} under the namespace "
                               f"\"{namespace}\"")
            if (repo_type, repo_id) in hub.repos:
                raise HubError(409, "You already created this repo")
            private = payload.get("visibility") == "private" or bool(payload.get("private"))
            hub.add_repo(repo_id, repo_type, private=private)
            return 200, {"url": f"{hub.url}/{URL_PREFIX[repo_type]}{repo_id}", "name": repo_id}

        match = re.fullmatch(r"/api/(model|dataset|space)s/(.+)", path)
        if match:
            repo_type = match.group(1)
            repo_id, tail = _split_repo(match.group(2))
            return _repo_api(hub, method, repo_type, repo_id, tail, query, body, user)

        match = re.fullmatch(r"/(datasets/|spaces/)?(.+)\.git/info/lfs/objects/batch", path)
        if method == "POST" and match:
            repo_type = {"datasets/": "dataset", "spaces/": "space", None: "model"}[match.group(1)]
            hub.repo(repo_type, match.group(2), user, write=True)
            payload = json.loads(body)
            objects = []
            for obj in payload["objects"]:
                entry = {"oid": obj["oid"], "size": obj["size"]}
                if obj["oid"] not in hub.lfs:  # already held: no actions, the client skips it
                    entry["actions"] = {"upload": {"href": f"{hub.url}/lfs-upload/{obj['oid']}"}}
                objects.append(entry)
            return 200, {"transfer": "basic", "objects": objects}

        match = re.fullmatch(r"/lfs-upload/([0-9a-f]{64})", path)
        if method == "PUT" and match:
            oid = match.group(1)
            if hashlib.sha256(body).hexdigest() != oid:
                raise HubError(400, "sha256 of the uploaded content does not match its oid")
            hub.lfs[oid] = body
            hub.uploads.append(oid)
            return 200, None

        raise HubError(404, f"no route for {method} {path}")

    return route


def _repo_api(hub: HubServer, method, repo_type, repo_id, tail, query, body, user):
    if method == "GET" and (tail == "" or tail.startswith("revision/")):
        repo = hub.repo(repo_type, repo_id, user)
        commit = hub.head(repo, tail.removeprefix("revision/") if tail else "main")
        siblings = [{"rfilename": p} for p in commit.files]
        return 200, {"id": repo_id, "sha": commit.oid, "private": repo.private, "siblings": siblings,
                     "author": repo_id.split("/")[0]}

    if method == "GET" and tail.startswith("tree/"):
        repo = hub.repo(repo_type, repo_id, user)
        revision, _, sub = tail.removeprefix("tree/").partition("/")
        commit = hub.head(repo, revision)
        recursive = query.get("recursive", ["False"])[0].lower() == "true"
        prefix = sub.rstrip("/") + "/" if sub else ""
        entries, folders = [], set()
        for file_path, blob in sorted(commit.files.items()):
            if not file_path.startswith(prefix):
                continue
            rest = file_path[len(prefix):]
            parts = rest.split("/")
            for depth in range(1, len(parts)):
                folder = prefix + "/".join(parts[:depth])
                if (recursive or depth == 1) and folder not in folders:
                    folders.add(folder)
                    entries.append({"type": "directory", "oid": "0" * 40, "size": 0, "path": folder})
            if recursive or len(parts) == 1:
                entries.append(_file_entry(file_path, blob))
        if sub and not entries:
            raise HubError(404, f"{sub} does not exist", "EntryNotFound")
        return 200, entries

    if method == "POST" and tail.startswith("paths-info/"):
        repo = hub.repo(repo_type, repo_id, user)
        commit = hub.head(repo, tail.removeprefix("paths-info/"))
        payload = _form_or_json(body)
        wanted = payload.get("paths", [])
        return 200, [_file_entry(p, commit.files[p]) for p in wanted if p in commit.files]

    if method == "POST" and tail.startswith("preupload/"):
        repo = hub.repo(repo_type, repo_id, user, write=True)
        commit = hub.head(repo, tail.removeprefix("preupload/"))
        files = []
        for item in json.loads(body)["files"]:
            sample = base64.b64decode(item["sample"])
            lfs = item["path"].endswith(LFS_SUFFIXES) or item["size"] > REGULAR_MAX or b"\0" in sample
            remote = commit.files.get(item["path"])
            oid = None
            if remote is not None:
                oid = remote.lfs if remote.lfs is not None else remote.oid
            files.append({"path": item["path"], "uploadMode": "lfs" if lfs else "regular",
                          "shouldIgnore": False, "oid": oid})
        return 200, {"files": files, "commitOid": commit.oid}

    if method == "POST" and tail.startswith("commit/"):
        repo = hub.repo(repo_type, repo_id, user, write=True)
        revision = tail.removeprefix("commit/")
        parent = hub.head(repo, revision)
        if revision not in repo.branches:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        if hub.fail_commits_after is not None and len(hub.commits) >= hub.fail_commits_after:
            raise HubError(503, "the stand-in Hub was told to fail this commit")
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        header = next(line["value"] for line in lines if line["key"] == "header")
        files = dict(parent.files)
        changed = []
        for line in lines:
            key, value = line["key"], line["value"]
            if key == "file":
                data = base64.b64decode(value["content"])
                files[value["path"]] = Blob(len(data), data)
            elif key == "lfsFile":
                if value["oid"] not in hub.lfs:
                    raise HubError(422, f"Your push was rejected because an LFS pointer pointed to a file that "
                                   f"does not exist. For instance: {value['path']}")
                files[value["path"]] = Blob(len(hub.lfs[value["oid"]]), lfs=value["oid"])
            elif key == "deletedFile":
                if value["path"] not in files:
                    raise HubError(404, "A file with this name doesn't exist", "EntryNotFound")
                del files[value["path"]]
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                for file_path in [p for p in files if p.startswith(prefix)]:
                    del files[file_path]
            else:
                continue
            changed.append(value["path"])
        commit = hub._new_commit(repo, revision, parent.oid, header["summary"], files)
        hub.commits.append((repo_id, revision, changed))
        url = f"{hub.url}/{URL_PREFIX[repo_type]}{repo_id}/commit/{commit.oid}"
        return 200, {"success": True, "commitOid": commit.oid, "commitUrl": url}

    raise HubError(404, f"no route for {method} /api/{repo_type}s/{repo_id}/{tail}")


def _form_or_json(body: bytes) -> dict:
    try:
        return json.loads(body)
    except ValueError:
        form = parse_qs(body.decode())
        return {"paths": form.get("paths", []), "expand": form.get("expand", [""])[0]}
