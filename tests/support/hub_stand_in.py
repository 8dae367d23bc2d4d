"""A loopback stand-in for the Hugging Face Hub: the routes ``huggingface_hub.snapshot_download`` calls (repo
info by revision, the recursive tree listing, HEAD and GET of ``resolve/``), over model folders on disk, reached
through ``HF_ENDPOINT``. No package provides one; the real Hub is unreachable here.

It answers as the Hub does where the client's behaviour depends on it: ``X-Error-Code`` (RepoNotFound,
RevisionNotFound, GatedRepo) on 401/403/404, ``X-Repo-Commit`` and ``ETag`` on a file, byte ranges (a resumed
download). It records every request, and can cut a file's first GET half-way (a connection lost mid-shard).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from flask import Flask, Response, request
from werkzeug.serving import make_server


@dataclass
class Repo:
    revisions: dict[str, str] = field(default_factory=dict)        # branch or tag -> commit
    commits: dict[str, Path] = field(default_factory=dict)         # commit -> folder
    gated: bool = False


class HubStandIn:
    def __init__(self, tokens: tuple[str, ...] = ("hf_valid_token",)) -> None:
        self.repos: dict[str, Repo] = {}
        self.tokens = set(tokens)
        self.requests: list[tuple[str, str]] = []    # (method, path)
        self.cut_once: set[str] = set()              # file names whose next GET stops half-way
        self.slow: dict[str, float] = {}             # file name -> seconds its body takes to send
        self.claimed_sizes: dict[str, int] = {}      # file name -> the size the listing claims (a disk too small)
        self.app = self._app()

    def add(self, repo_id: str, folder: Path, revision: str = "main", gated: bool = False) -> str:
        """Publish a folder as ``repo_id`` at ``revision``; returns the commit hash."""
        digest = hashlib.sha1(repo_id.encode() + revision.encode())
        for path in sorted(folder.iterdir()):
            digest.update(path.name.encode() + path.read_bytes()[:4096])
        commit = digest.hexdigest()
        repo = self.repos.setdefault(repo_id, Repo())
        repo.revisions[revision], repo.commits[commit], repo.gated = commit, folder, repo.gated or gated
        return commit

    def downloads(self) -> list[str]:
        """The files fetched so far (GETs of resolve/)."""
        return [path.rsplit("/", 1)[-1] for method, path in self.requests if method == "GET" and "/resolve/" in path]

    def __enter__(self) -> HubStandIn:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request would bury the test output
        self.server = make_server("127.0.0.1", 0, self.app, threaded=True)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()

    def _app(self) -> Flask:
        app = Flask("hub-stand-in")

        @app.errorhandler(Abort)
        def aborted(error: Abort) -> Response:
            return error.response

        @app.before_request
        def record():
            self.requests.append((request.method, request.path))

        @app.get("/api/models/<org>/<name>/revision/<path:revision>")
        def info(org: str, name: str, revision: str):
            repo, commit = self._resolve(f"{org}/{name}", revision)
            files = sorted(p.name for p in repo.commits[commit].iterdir())
            return {"id": f"{org}/{name}", "sha": commit, "private": False, "gated": "auto" if repo.gated else False,
                    "siblings": [{"rfilename": f} for f in files]}

        @app.get("/api/models/<org>/<name>/tree/<path:revision>")
        def tree(org: str, name: str, revision: str):
            repo, commit = self._resolve(f"{org}/{name}", revision)
            return [{"type": "file", "path": p.name, "size": self.claimed_sizes.get(p.name, p.stat().st_size),
                     "oid": sha(p)[:40]}
                    for p in sorted(repo.commits[commit].iterdir())]

        @app.route("/<org>/<name>/resolve/<revision>/<path:filename>", methods=["GET", "HEAD"])
        def resolve(org: str, name: str, revision: str, filename: str):
            repo, commit = self._resolve(f"{org}/{name}", revision)
            if repo.gated and request.headers.get("Authorization", "").removeprefix("Bearer ") not in self.tokens:
                return refuse(401 if "Authorization" not in request.headers else 403, "GatedRepo",
                              f"Access to model {org}/{name} is restricted.")
            path = repo.commits[commit] / filename
            if not path.is_file():
                return refuse(404, "EntryNotFound", f"{filename} does not exist")
            return self._file(path, commit)

        return app

    def _resolve(self, repo_id: str, revision: str) -> tuple[Repo, str]:
        repo = self.repos.get(repo_id)
        if repo is None:
            raise Abort(refuse(404, "RepoNotFound", f"Repository Not Found for url: {request.url}"))
        commit = repo.revisions.get(revision, revision)
        if commit not in repo.commits:
            raise Abort(refuse(404, "RevisionNotFound", f"Invalid rev id: {revision}"))
        return repo, commit

    def _file(self, path: Path, commit: str) -> Response:
        data = path.read_bytes()
        start = 0
        if request.headers.get("Range", "").startswith("bytes="):
            start = int(request.headers["Range"][len("bytes="):].split("-")[0])
        headers = {"X-Repo-Commit": commit, "ETag": f'"{sha(path)}"', "Accept-Ranges": "bytes",
                   "Content-Length": str(len(data) - start)}
        status = 206 if start else 200
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        if request.method == "HEAD":
            return Response(status=status, headers=headers)
        body = data[start:]
        if path.name in self.cut_once:
            self.cut_once.discard(path.name)
            return Response(cut(body), status=status, headers=headers)
        if path.name in self.slow:
            return Response(slowly(body, self.slow[path.name]), status=status, headers=headers)
        return Response(body, status=status, headers=headers)


class Abort(Exception):
    def __init__(self, response: Response) -> None:
        self.response = response


def refuse(status: int, code: str, message: str) -> Response:
    return Response(f'{{"error": "{message}"}}', status=status, mimetype="application/json",
                    headers={"X-Error-Code": code, "X-Error-Message": message})


def cut(body: bytes):
    """Half the body, then the connection drops (werkzeug closes it when the generator raises)."""
    yield body[: len(body) // 2]
    raise ConnectionResetError("the stand-in cut this download half-way")


def slowly(body: bytes, seconds: float, parts: int = 50):
    """The body in equal parts over ``seconds`` (a download long enough to watch)."""
    step = max(1, len(body) // parts)
    for start in range(0, len(body), step):
        time.sleep(seconds / parts)
        yield body[start:start + step]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    """``python -m tests.support.hub_stand_in org/name=FOLDER ...``: serve until killed; prints the endpoint
    (ci/image_test.sh points a container's HF_ENDPOINT at it)."""
    import sys

    with HubStandIn() as hub:
        for argument in sys.argv[1:]:
            repo_id, folder = argument.split("=", 1)
            hub.add(repo_id, Path(folder))
        print(hub.url, flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main()
