"""A local stand-in for the Hugging Face Hub: the few HTTP calls huggingface_hub makes to create a model repo,
upload a folder (preupload, the LFS batch API with the basic transfer, commit), list a repo's tree, read its
info and download a file. No network: it listens on 127.0.0.1 in a thread of the test process.

What the real Hub does and this one copies: files are committed only with a commit (ndjson: header, ``file``
with base64 content, ``lfsFile`` naming an object uploaded before, ``deletedFile``); a file is stored in LFS
when it is binary or has an LFS suffix; the tree lists ``oid`` (the git blob sha1), ``size`` and, for LFS
files, ``lfs.oid`` (sha256) and ``lfs.size``; the tree is paginated by a ``Link: <...>; rel="next"`` header;
errors carry ``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound); writes need the token.

Faults for tests: ``refuse_commits_under`` (a path prefix whose commit is answered 403, once),
``truncate`` / ``replace`` (change a stored file behind the uploader's back), ``requests`` (every call made).
Uploads go through huggingface_hub's LFS protocol (``HF_HUB_DISABLE_XET``): the Xet storage protocol of
newer Hub repos is not spoken here.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit


def point_huggingface_hub_at(hub: FakeHub, monkeypatch: Any, home: Any) -> None:
    """huggingface_hub in this process talks to ``hub`` (its endpoint, URL template and token; the LFS protocol;
    online; a cache under ``home``): what HF_ENDPOINT, HF_TOKEN and HF_HUB_DISABLE_XET do in a fresh process."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_TOKEN", hub.token)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home) + "/hub")


LFS_SUFFIXES = (".onnx", ".data", ".onnx_data", ".safetensors", ".bin", ".gguf", ".msgpack")


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Stored:
    data: bytes
    lfs: bool


@dataclass
class Repo:
    private: bool = False
    commits: list[tuple[str, dict[str, Stored]]] = field(default_factory=list)  # newest last

    def at(self, revision: str) -> tuple[str, dict[str, Stored]] | None:
        if revision == "main":
            return self.commits[-1]
        return next((c for c in self.commits if c[0] == revision), None)


class FakeHub:
    """The server's state; ``url`` is the endpoint to give huggingface_hub."""

    def __init__(self, token: str = "hf_test_token", page_size: int = 50) -> None:
        self.token = token
        self.page_size = page_size
        self.repos: dict[str, Repo] = {}
        self.objects: dict[str, bytes] = {}  # LFS store: sha256 -> bytes
        self.requests: list[tuple[str, str]] = []
        self.refuse_commits_under: str | None = None
        self.lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- test helpers ------------------------------------------------------------------------------------
    def files(self, repo: str, revision: str = "main") -> dict[str, bytes]:
        got = self.repos[repo].at(revision)
        assert got is not None
        return {p: s.data for p, s in got[1].items()}

    def commit_count(self, repo: str) -> int:
        return len(self.repos[repo].commits)

    def put_files(self, repo: str, files: dict[str, bytes], message: str = "by hand") -> str:
        """A commit made by someone else (a hand upload, a broken client)."""
        r = self.repos.setdefault(repo, Repo())
        tree = dict(r.commits[-1][1]) if r.commits else {}
        for path, data in files.items():
            lfs = _is_lfs(path, data)
            tree[path] = Stored(data, lfs)
            if lfs:
                self.objects[hashlib.sha256(data).hexdigest()] = data
        return self._commit(r, tree, message)

    def drop_file(self, repo: str, path: str) -> str:
        r = self.repos[repo]
        tree = dict(r.commits[-1][1])
        del tree[path]
        return self._commit(r, tree, f"delete {path}")

    def _commit(self, repo: Repo, tree: dict[str, Stored], message: str) -> str:
        sha = hashlib.sha1(f"{len(repo.commits)}:{message}:{sorted(tree)}".encode()).hexdigest()
        repo.commits.append((sha, tree))
        return sha

    def create(self, repo: str) -> None:
        r = self.repos.setdefault(repo, Repo())
        if not r.commits:
            self._commit(r, {".gitattributes": Stored(b"*.onnx filter=lfs diff=lfs merge=lfs -text\n", False)},
                         "initial commit")


def _is_lfs(path: str, data: bytes) -> bool:
    return path.endswith(LFS_SUFFIXES) or b"\0" in data[:512]


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # quiet
            pass

        # -- plumbing ------------------------------------------------------------------------------------
        def _body(self) -> bytes:
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _send(self, status: int, body: bytes | dict | list = b"", headers: dict[str, str] | None = None,
                  head: bool = False) -> None:
            if isinstance(body, dict | list):
                body = json.dumps(body).encode()
                headers = {"Content-Type": "application/json", **(headers or {})}
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _error(self, status: int, code: str | None, message: str, head: bool = False) -> None:
            headers = {"X-Error-Code": code} if code else {}
            headers["X-Error-Message"] = message
            self._send(status, b"" if head else {"error": message}, headers, head=head)

        def _authorized(self) -> bool:
            if self.headers.get("Authorization") == f"Bearer {hub.token}":
                return True
            self._error(401, None, "Invalid credentials in Authorization header")
            return False

        def _repo(self, repo_id: str, head: bool = False) -> Repo | None:
            r = hub.repos.get(repo_id)
            if r is None:
                self._error(404, "RepoNotFound", "Repository not found", head=head)
            return r

        def _at(self, r: Repo, revision: str, head: bool = False) -> tuple[str, dict[str, Stored]] | None:
            got = r.at(unquote(revision))
            if got is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {unquote(revision)}", head=head)
            return got

        def _write_target(self, repo_id: str, revision: str) -> tuple[Repo, str, dict[str, Stored]] | None:
            """A write's repo and its state at ``revision``; None when the answer (an error) is sent."""
            if not self._authorized():
                return None
            r = self._repo(repo_id)
            got = None if r is None else self._at(r, revision)
            return None if r is None or got is None else (r, *got)

        def _dispatch(self, method: str) -> None:
            url = urlsplit(self.path)
            path, query = unquote(url.path), parse_qs(url.query)
            hub.requests.append((method, path))
            with hub.lock:
                for pattern, name in ROUTES:
                    m = re.fullmatch(pattern, path)
                    if m and name.split("_", 1)[0] == method.lower():
                        getattr(self, name)(*m.groups(), query=query)
                        return
            self._error(404, None, f"no route {method} {path}")

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_HEAD(self) -> None:
            self._dispatch("HEAD")

        def do_POST(self) -> None:
            self._dispatch("POST")

        def do_PUT(self) -> None:
            self._dispatch("PUT")

        # -- routes --------------------------------------------------------------------------------------
        def post_create(self, query: dict) -> None:
            body = json.loads(self._body() or b"{}")
            if not self._authorized():
                return
            repo_id = f"{body.get('organization') or 'me'}/{body['name']}"
            if repo_id in hub.repos:
                self._error(409, None, "You already created this model repo")
                return
            hub.create(repo_id)
            hub.repos[repo_id].private = body.get("visibility") == "private"
            self._send(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})

        def get_info(self, repo_id: str, revision: str | None, query: dict) -> None:
            r = self._repo(repo_id)
            if r is None:
                return
            got = self._at(r, revision or "main")
            if got is None:
                return
            sha, tree = got
            self._send(200, {"id": repo_id, "modelId": repo_id, "sha": sha, "private": r.private,
                             "siblings": [{"rfilename": p} for p in sorted(tree)]})

        def get_tree(self, repo_id: str, revision: str, sub: str | None, query: dict) -> None:
            r = self._repo(repo_id)
            if r is None:
                return
            got = self._at(r, revision)
            if got is None:
                return
            _, tree = got
            prefix = (sub.strip("/") + "/") if sub else ""
            recursive = query.get("recursive", ["False"])[0].lower() == "true"
            entries: dict[str, dict] = {}
            for p, s in sorted(tree.items()):
                if not p.startswith(prefix):
                    continue
                rest = p[len(prefix):]
                if "/" in rest and not recursive:
                    d = prefix + rest.split("/", 1)[0]
                    entries[d] = {"type": "directory", "oid": "0" * 40, "path": d}
                    continue
                if recursive:  # the folders on the way
                    parts = rest.split("/")[:-1]
                    for i in range(1, len(parts) + 1):
                        d = prefix + "/".join(parts[:i])
                        entries.setdefault(d, {"type": "directory", "oid": "0" * 40, "path": d})
                e: dict[str, Any] = {"type": "file", "oid": git_sha1(s.data), "size": len(s.data), "path": p}
                if s.lfs:
                    e["lfs"] = {"oid": hashlib.sha256(s.data).hexdigest(), "size": len(s.data), "pointerSize": 134}
                entries[p] = e
            if sub and not entries:
                self._error(404, "EntryNotFound", f"{sub} does not exist on {revision}")
                return
            items = [entries[k] for k in sorted(entries)]
            start = int(query.get("cursor", ["0"])[0])
            page = items[start:start + hub.page_size]
            headers = {}
            if start + hub.page_size < len(items):
                nxt = f"{hub.url}{urlsplit(self.path).path}?recursive={recursive}&cursor={start + hub.page_size}"
                headers["Link"] = f'<{nxt}>; rel="next"'
            self._send(200, page, headers)

        def get_resolve(self, repo_id: str, revision: str, filename: str, query: dict, head: bool = False) -> None:
            r = self._repo(repo_id, head)
            if r is None:
                return
            got = self._at(r, revision, head)
            if got is None:
                return
            sha, tree = got
            s = tree.get(filename)
            if s is None:
                self._error(404, "EntryNotFound", f"{filename} does not exist", head=head)
                return
            headers = {"X-Repo-Commit": sha, "ETag": f'"{git_sha1(s.data)}"'}
            if s.lfs:
                headers["X-Linked-Etag"] = f'"{hashlib.sha256(s.data).hexdigest()}"'
                headers["X-Linked-Size"] = str(len(s.data))
            self._send(200, s.data, headers, head=head)

        def head_resolve(self, repo_id: str, revision: str, filename: str, query: dict) -> None:
            self.get_resolve(repo_id, revision, filename, query, head=True)

        def post_preupload(self, repo_id: str, revision: str, query: dict) -> None:
            body = json.loads(self._body())
            target = self._write_target(repo_id, revision)
            if target is None:
                return
            _, commit, tree = target
            files = []
            for f in body["files"]:
                sample = base64.b64decode(f["sample"])
                lfs = _is_lfs(f["path"], sample)
                old = tree.get(f["path"])
                oid = None if old is None else (hashlib.sha256(old.data).hexdigest() if old.lfs
                                                else git_sha1(old.data))
                files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                              "oid": oid})
            self._send(200, {"files": files, "commitOid": commit})

        def post_batch(self, repo_id: str, query: dict) -> None:
            body = json.loads(self._body())
            if not self._authorized():
                return
            out = []
            for o in body["objects"]:
                entry: dict[str, Any] = {"oid": o["oid"], "size": o["size"]}
                if o["oid"] not in hub.objects:
                    entry["actions"] = {"upload": {"href": f"{hub.url}/lfs-upload/{o['oid']}"},
                                        "verify": {"href": f"{hub.url}/lfs-verify/{o['oid']}"}}
                out.append(entry)
            self._send(200, {"transfer": "basic", "objects": out})

        def put_upload(self, oid: str, query: dict) -> None:
            data = self._body()
            if hashlib.sha256(data).hexdigest() != oid:
                self._error(400, None, "sha256 does not match the object id")
                return
            hub.objects[oid] = data
            self._send(200, b"")

        def post_verify(self, oid: str, query: dict) -> None:
            body = json.loads(self._body())
            ok = oid in hub.objects and len(hub.objects[oid]) == body.get("size")
            self._send(200 if ok else 404, {"ok": ok})

        def post_commit(self, repo_id: str, revision: str, query: dict) -> None:
            lines = [json.loads(x) for x in self._body().splitlines() if x.strip()]
            target = self._write_target(repo_id, revision)
            if target is None:
                return
            r, _, tree = target
            tree = dict(tree)
            summary = ""
            paths = []
            for line in lines:
                v = line["value"]
                if line["key"] == "header":
                    summary = v.get("summary", "")
                elif line["key"] == "file":
                    tree[v["path"]] = Stored(base64.b64decode(v["content"]), False)
                    paths.append(v["path"])
                elif line["key"] == "lfsFile":
                    data = hub.objects.get(v["oid"])
                    if data is None:
                        self._error(422, None, f"LFS object {v['oid']} was never uploaded")
                        return
                    tree[v["path"]] = Stored(data, True)
                    paths.append(v["path"])
                elif line["key"] == "deletedFile":
                    tree.pop(v["path"], None)
            fence = hub.refuse_commits_under
            if fence is not None and any(p.startswith(fence) for p in paths):
                hub.refuse_commits_under = None  # once
                self._error(403, None, "You don't have the rights to create a commit here (refused by the test)")
                return
            sha = hub._commit(r, tree, summary)
            self._send(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{sha}", "commitOid": sha,
                             "pullRequestUrl": None})

    return Handler


_REPO = r"([^/]+/[^/]+?)"
ROUTES = [
    (r"/api/repos/create", "post_create"),
    (rf"/api/models/{_REPO}(?:/revision/(.+))?", "get_info"),
    (rf"/api/models/{_REPO}/tree/([^/]+)(?:/(.+))?", "get_tree"),
    (rf"/api/models/{_REPO}/preupload/([^/]+)", "post_preupload"),
    (rf"/api/models/{_REPO}/commit/([^/]+)", "post_commit"),
    (rf"/{_REPO}\.git/info/lfs/objects/batch", "post_batch"),
    (r"/lfs-upload/([0-9a-f]{64})", "put_upload"),
    (r"/lfs-verify/([0-9a-f]{64})", "post_verify"),
    (rf"/{_REPO}/resolve/([^/]+)/(.+)", "get_resolve"),
    (rf"/{_REPO}/resolve/([^/]+)/(.+)", "head_resolve"),
]
