"""A stand-in for the Hugging Face hub on loopback: the HTTP API huggingface_hub downloads with.

Point `HF_ENDPOINT` at `HubStandIn.url`. It answers what `snapshot_download` and
`hf_hub_download` (huggingface_hub 2.x) call, with the headers they require:

  GET  /api/models/{repo}/revision/{rev}   model info: sha (the commit), siblings, gated
  GET  /api/models/{repo}/tree/{rev}       recursive file listing (path, size, oid, lfs)
  HEAD /{repo}/resolve/{rev}/{file}        X-Repo-Commit and ETag; LFS files (weights)
                                           answer 302 to a second origin, the "CDN", with
                                           X-Linked-Etag (sha256) and X-Linked-Size, as
                                           the hub does
  GET  /{repo}/resolve/{rev}/{file}        the bytes (small files)
  GET  cdn /blobs/{sha256}                 the bytes of an LFS file

Errors carry the hub's X-Error-Code header, which huggingface_hub turns into its
exceptions: RepoNotFound (404), RevisionNotFound (404), EntryNotFound (404), GatedRepo
(401 without a token, 403 with one that is not allowed). Gated repos show their info
and listing to anyone, like the hub; only their files need an allowed token.

Every request is logged (`requests`): which server, method, path and Authorization header.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@dataclass
class Repo:
    """One model repository at one commit: file name -> bytes."""

    files: dict[str, bytes]
    gated: bool = False
    allowed_tokens: set[str] = field(default_factory=set)
    commit: str = ""

    def __post_init__(self):
        if not self.commit:
            digest = hashlib.sha1()
            for name in sorted(self.files):
                digest.update(name.encode() + hashlib.sha1(self.files[name]).digest())
            self.commit = digest.hexdigest()

    @staticmethod
    def from_dir(path: str, **kwargs) -> "Repo":
        files = {}
        for root, _, names in os.walk(path):
            for name in names:
                full = os.path.join(root, name)
                with open(full, "rb") as f:
                    files[os.path.relpath(full, path).replace(os.sep, "/")] = f.read()
        return Repo(files, **kwargs)


@dataclass(frozen=True)
class LoggedRequest:
    server: str  # "hub" or "cdn"
    method: str
    path: str
    authorization: str | None


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_lfs(name: str) -> bool:
    return name.endswith(LFS_SUFFIXES)


class HubStandIn:
    """The hub and its CDN on two loopback ports; use as a context manager."""

    def __init__(self, repos: dict[str, Repo]):
        self.repos = repos
        self.requests: list[LoggedRequest] = []
        self._blobs = {hashlib.sha256(d).hexdigest(): d
                       for repo in repos.values() for d in repo.files.values()}
        self._hub = ThreadingHTTPServer(("127.0.0.1", 0), self._handler("hub"))
        self._cdn = ThreadingHTTPServer(("127.0.0.1", 0), self._handler("cdn"))
        self.url = f"http://127.0.0.1:{self._hub.server_address[1]}"
        self.cdn_url = f"http://127.0.0.1:{self._cdn.server_address[1]}"

    def __enter__(self) -> "HubStandIn":
        for server in (self._hub, self._cdn):
            threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        for server in (self._hub, self._cdn):
            server.shutdown()
            server.server_close()

    def fetched_files(self, repo_id: str) -> set[str]:
        """Files whose bytes were sent (GET on resolve, or on the CDN for LFS files)."""
        repo = self.repos[repo_id]
        by_sha = {hashlib.sha256(d).hexdigest(): n for n, d in repo.files.items()}
        names = set()
        for r in self.requests:
            if r.method != "GET":
                continue
            if r.server == "cdn":
                name = by_sha.get(r.path.rsplit("/", 1)[-1])
                if name is not None:
                    names.add(name)
            elif f"/{repo_id}/resolve/" in r.path:
                names.add(r.path.split("/resolve/", 1)[1].split("/", 1)[1])
        return names

    # ------------------------------------------------------------------ handlers
    def _handler(self, server_name: str):
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output clean
                pass

            def do_GET(self):
                stand_in._serve(self, server_name, body=True)

            def do_HEAD(self):
                stand_in._serve(self, server_name, body=False)

        return Handler

    def _serve(self, req: BaseHTTPRequestHandler, server_name: str, body: bool) -> None:
        path = unquote(urlsplit(req.path).path)
        self.requests.append(LoggedRequest(server_name, req.command, path,
                                           req.headers.get("Authorization")))
        if server_name == "cdn":
            data = self._blobs.get(path.removeprefix("/blobs/"))
            if data is None:
                return _reply(req, 404, {}, b"", body)
            return _reply(req, 200, {"Content-Type": "application/octet-stream"}, data, body)
        if path.startswith("/api/models/"):
            return self._api(req, path.removeprefix("/api/models/"), body)
        if "/resolve/" in path:
            return self._resolve(req, path.lstrip("/"), body)
        _reply(req, 404, {}, b"", body)

    def _repo_or_404(self, req, repo_id: str, body: bool) -> Repo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            _error(req, 404, "RepoNotFound", "Repository not found", body)
        return repo

    def _revision_ok(self, req, repo: Repo, rev: str, body: bool) -> bool:
        if rev in ("main", repo.commit):
            return True
        _error(req, 404, "RevisionNotFound", "Invalid rev id: " + rev, body)
        return False

    def _api(self, req, rest: str, body: bool) -> None:
        for action in ("/revision/", "/tree/"):
            if action in rest:
                repo_id, rev = rest.split(action, 1)
                break
        else:
            return _reply(req, 404, {}, b"", body)
        repo = self._repo_or_404(req, repo_id, body)
        if repo is None or not self._revision_ok(req, repo, rev, body):
            return
        if action == "/revision/":
            payload = {"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False,
                       "gated": "manual" if repo.gated else False,
                       "siblings": [{"rfilename": n} for n in sorted(repo.files)]}
        else:
            payload = [self._tree_entry(n, d) for n, d in sorted(repo.files.items())]
        data = json.dumps(payload).encode()
        _reply(req, 200, {"Content-Type": "application/json"}, data, body)

    @staticmethod
    def _tree_entry(name: str, data: bytes) -> dict:
        entry = {"type": "file", "path": name, "size": len(data), "oid": _git_oid(data)}
        if _is_lfs(name):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                            "pointerSize": 134}
        return entry

    def _resolve(self, req, rest: str, body: bool) -> None:
        repo_id, tail = rest.split("/resolve/", 1)
        rev, _, filename = tail.partition("/")
        repo = self._repo_or_404(req, repo_id, body)
        if repo is None or not self._revision_ok(req, repo, rev, body):
            return
        if repo.gated:
            auth = req.headers.get("Authorization") or ""
            token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None
            if token is None:
                return _error(req, 401, "GatedRepo", "Access to model is restricted", body)
            if token not in repo.allowed_tokens:
                return _error(req, 403, "GatedRepo", "Access to model is restricted", body)
        data = repo.files.get(filename)
        commit = {"X-Repo-Commit": repo.commit}
        if data is None:
            return _error(req, 404, "EntryNotFound", "Entry not found", body, commit)
        if _is_lfs(filename):
            sha = hashlib.sha256(data).hexdigest()
            return _reply(req, 302, {**commit, "Location": f"{self.cdn_url}/blobs/{sha}",
                                     "ETag": f'"{_git_oid(data)}"', "X-Linked-Etag": f'"{sha}"',
                                     "X-Linked-Size": str(len(data))}, b"", body)
        _reply(req, 200, {**commit, "ETag": f'"{_git_oid(data)}"'}, data, body)


def _error(req, status: int, code: str, message: str, body: bool,
           headers: dict | None = None) -> None:
    data = json.dumps({"error": message}).encode()
    _reply(req, status, {**(headers or {}), "X-Error-Code": code, "X-Error-Message": message,
                         "Content-Type": "application/json"}, data, body)


def _reply(req, status: int, headers: dict, data: bytes, body: bool) -> None:
    req.send_response(status)
    for name, value in headers.items():
        req.send_header(name, value)
    req.send_header("Content-Length", str(len(data)))
    req.end_headers()
    if body:
        req.wfile.write(data)
