"""A local stand-in for the Hugging Face hub, for runs pointed at it through $HF_ENDPOINT: the endpoints that
huggingface_hub's snapshot_download and hf_hub_download call, on Python's threaded HTTP server on 127.0.0.1.

    GET  /api/{models,datasets}/REPO/revision/REV     the repo's commit (one per repo: "main" and its sha)
    GET  /api/{models,datasets}/REPO/tree/REV         its files, recursive, with sizes and git blob ids
    HEAD /[datasets/]REPO/resolve/REV/FILE            ETag, X-Repo-Commit and Content-Length of a file
    GET  /[datasets/]REPO/resolve/REV/FILE            its bytes (Range: bytes=N- answered 206)

An unknown repo answers 404 with the hub's X-Error-Code RepoNotFound. `requests` lists what was asked (method, path,
Range header); `cut_once` names files whose first GET sends half the body and closes the connection, as a dropped
link would."""
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    folder: Path
    sha: str  # the commit every revision name resolves to


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)  # "models/org/name" or "datasets/org/name" -> repo
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    cut_once: set[str] = field(default_factory=set)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, repo_id: str, folder: Path, kind: str = "models") -> str:
        """Serve `folder`'s files as repo `repo_id`; returns its commit sha."""
        digest = hashlib.sha1()
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            digest.update(path.relative_to(folder).as_posix().encode() + path.read_bytes())
        self.repos[f"{kind}/{repo_id}"] = Repo(folder, digest.hexdigest())
        return digest.hexdigest()

    def downloads(self, name: str) -> list[str | None]:
        """The Range header of each GET of a file named `name` (None: the whole file)."""
        return [rng for method, path, rng in self.requests if method == "GET" and path.endswith("/" + name)]

    def __enter__(self) -> "FakeHub":
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub.answer(self, body=False)

            def do_GET(self):
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(handler.path).path)
        self.requests.append((handler.command, path, handler.headers.get("Range")))
        api = re.fullmatch(r"/api/(models|datasets)/(.+?)/(revision|tree)/([^/]+)(/.*)?", path)
        if api:
            kind, repo_id, what, _, _ = api.groups()
            repo = self.repos.get(f"{kind}/{repo_id}")
            if repo is None:
                return self.not_found(handler)
            files = sorted(p for p in repo.folder.rglob("*") if p.is_file())
            if what == "revision":
                data = {"id": repo_id, "sha": repo.sha, "siblings": [
                    {"rfilename": p.relative_to(repo.folder).as_posix()} for p in files]}
            else:
                data = [{"type": "file", "path": p.relative_to(repo.folder).as_posix(), "size": p.stat().st_size,
                         "oid": git_blob_id(p.read_bytes())} for p in files]
            return self.send(handler, 200, json.dumps(data).encode(), {"Content-Type": "application/json"}, body)
        resolve = re.fullmatch(r"/(datasets/)?(.+?)/resolve/([^/]+)/(.+)", path)
        if not resolve:
            return self.not_found(handler)
        kind = "datasets" if resolve.group(1) else "models"
        repo = self.repos.get(f"{kind}/{resolve.group(2)}")
        file = repo and repo.folder / resolve.group(4)
        if repo is None or not file.is_file():
            return self.not_found(handler, "EntryNotFound" if repo else "RepoNotFound")
        data = file.read_bytes()
        headers = {"ETag": f'"{git_blob_id(data)}"', "X-Repo-Commit": repo.sha, "Accept-Ranges": "bytes"}
        start = int(re.fullmatch(r"bytes=(\d+)-", handler.headers.get("Range") or "bytes=0-").group(1))
        if body and start == 0 and file.name in self.cut_once:
            self.cut_once.discard(file.name)
            handler.send_response(200)
            for k, v in headers.items():
                handler.send_header(k, v)
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data[:len(data) // 2])
            handler.wfile.flush()
            handler.close_connection = True
            return
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        self.send(handler, 206 if start else 200, data[start:], headers, body)

    @staticmethod
    def send(handler, status: int, data: bytes, headers: dict, body: bool) -> None:
        handler.send_response(status)
        for k, v in headers.items():
            handler.send_header(k, v)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if body:
            handler.wfile.write(data)

    def not_found(self, handler, code: str = "RepoNotFound") -> None:
        message = json.dumps({"error": "Repository not found" if code == "RepoNotFound" else "Entry not found"})
        self.send(handler, 404, message.encode(), {"X-Error-Code": code, "X-Error-Message": json.loads(message)["error"],
                                                   "Content-Type": "application/json"}, handler.command != "HEAD")


def git_blob_id(data: bytes) -> str:
    """The git object id of a file's bytes: what the hub reports as a (non-LFS) file's oid and ETag."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
