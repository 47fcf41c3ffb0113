"""A local stand-in for the Hugging Face Hub's HTTP API that records every request.

It answers, in the shapes the Hub documents and huggingface_hub 2.4 parses, what this project's push path uses:
whoami, the write auth-check, repo creation, branches (create, list), the tree of a revision, preupload (every file
"regular", so contents travel inside the commit and the stand-in keeps them) and commits (NDJSON), plus validate-yaml
for model cards. Repos live in memory: {repo: {branch: {path: bytes}}}. Anything else is answered 404 and recorded,
so a test sees a request it did not expect.

Faults are injected per (kind, revision): `fail` answers 500 (with `Retry-After: 0`, which huggingface_hub honours
after one second) a number of times (-1: always); `hold` runs a function before answering (to delay an upload until
something happened on disk).
"""

import base64
import hashlib
import http.server
import json
import re
import threading
import time
from urllib.parse import parse_qs, unquote, urlparse

GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"  # a new repo's first commit
REPO = r"(?P<repo>[^/]+/[^/]+)"
ROUTES = [
    ("GET", r"/api/whoami-v2", "whoami"),
    ("GET", rf"/api/models/{REPO}/auth-check/write", "auth_check"),
    ("POST", r"/api/repos/create", "create_repo"),
    ("POST", rf"/api/models/{REPO}/branch/(?P<rev>[^/]+)", "create_branch"),
    ("GET", rf"/api/models/{REPO}/refs", "refs"),
    ("GET", rf"/api/models/{REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?", "tree"),
    ("POST", rf"/api/models/{REPO}/preupload/(?P<rev>[^/]+)", "preupload"),
    ("POST", rf"/api/models/{REPO}/commit/(?P<rev>[^/]+)", "commit"),
    ("POST", r"/api/validate-yaml", "validate_yaml"),
]


def whoami_answer(role="write", orgs=(), scoped=()):
    """HfApi.whoami()'s answer, in the shape /api/whoami-v2 returns (user, orgs with roles, the token's auth)."""
    token = {"displayName": "cluster", "role": role}
    if role == "fineGrained":
        token["fineGrained"] = {"canReadGatedRepos": True, "global": [], "scoped": list(scoped)}
    return {
        "type": "user",
        "name": "me",
        "orgs": [{"type": "org", "name": name, "roleInOrg": r} for name, r in orgs],
        "auth": {"type": "access_token", "accessToken": token},
    }


def git_blob_id(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class HubState:
    """What the stand-in knows and saw; tests read and set it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: list[dict] = []  # every request: method, kind, path, revision, auth, time
        self.commits: list[dict] = []  # every accepted commit: repo, revision, message, files {path: bytes}, deleted
        self.repos: dict[str, dict[str, dict[str, bytes]]] = {}
        self.heads: dict[tuple[str, str], str] = {}  # (repo, branch) -> commit id
        self.whoami = whoami_answer(orgs=[("lab", "contributor")])
        self.whoami_status = 200
        self.auth_status: dict[str, int] = {}  # repo -> status of its write auth-check (default: 200 if it exists)
        self.fail: dict[tuple[str, str], int] = {}  # (kind, revision) -> failures left (-1: always)
        self.hold: dict[tuple[str, str], object] = {}  # (kind, revision) -> fn() run before answering

    def of(self, kind: str) -> list[dict]:
        return [r for r in self.requests if r["kind"] == kind]


class Handler(http.server.BaseHTTPRequestHandler):
    state: HubState  # set per server

    def do_GET(self):
        self.route("GET")

    def do_POST(self):
        self.route("POST")

    def route(self, method):
        url = urlparse(self.path)
        body = self.read_body()
        kind, match = "unknown", None
        for verb, pattern, name in ROUTES:
            if verb == method and re.fullmatch(pattern, url.path):
                kind, match = name, re.fullmatch(pattern, url.path)
                break
        params = {k: unquote(v) for k, v in (match.groupdict() if match else {}).items() if v is not None}
        record = {
            "method": method, "kind": kind, "path": url.path, "repo": params.get("repo"), "revision": params.get("rev"),
            "auth": self.headers.get("Authorization"), "time": time.time(),
        }  # fmt: skip
        with self.state.lock:
            self.state.requests.append(record)
            left = self.state.fail.get((kind, params.get("rev")), 0)
            if left:
                self.state.fail[(kind, params.get("rev"))] = left - 1 if left > 0 else left
        hold = self.state.hold.get((kind, params.get("rev")))
        if hold:
            hold()
        if left:
            return self.reply(500, {"error": "Internal Error - We're working hard to fix this"}, {"Retry-After": "0"})
        if kind == "unknown":
            return self.reply(404, {"error": f"the stand-in does not know {method} {url.path}"})
        getattr(self, kind)(params, body, parse_qs(url.query))

    def read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    # --- endpoints ---

    def whoami(self, params, body, query):
        self.reply(self.state.whoami_status, self.state.whoami)

    def auth_check(self, params, body, query):
        repo = params["repo"]
        status = self.state.auth_status.get(repo, 200 if repo in self.state.repos else 404)
        headers = {"X-Error-Code": "RepoNotFound"} if status == 404 else {}
        self.reply(status, {"error": "nope"} if status != 200 else {}, headers)

    def create_repo(self, params, body, query):
        payload = json.loads(body)
        repo = f"{payload['organization'] or self.state.whoami['name']}/{payload['name']}"
        with self.state.lock:
            if repo in self.state.repos:
                return self.reply(409, {"error": "You already created this model repo", "url": self.url(repo)})
            self.state.repos[repo] = {"main": {".gitattributes": GITATTRIBUTES}}
            self.state.heads[(repo, "main")] = hashlib.sha1(repo.encode()).hexdigest()
        self.reply(200, {"url": self.url(repo), "name": repo, "id": repo})

    def create_branch(self, params, body, query):
        repo, branch = params["repo"], params["rev"]
        with self.state.lock:
            branches = self.state.repos.get(repo)
            if branches is None:
                return self.reply(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            if branch in branches:
                return self.reply(409, {"error": "Reference already exists"})
            branches[branch] = dict(branches["main"])
            self.state.heads[(repo, branch)] = self.state.heads[(repo, "main")]
        self.reply(200, {})

    def refs(self, params, body, query):
        repo = params["repo"]
        if repo not in self.state.repos:
            return self.reply(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
        branches = [
            {"name": b, "ref": f"refs/heads/{b}", "targetCommit": self.state.heads[(repo, b)]}
            for b in self.state.repos[repo]
        ]
        self.reply(200, {"branches": branches, "converts": [], "tags": []})

    def tree(self, params, body, query):
        files = self.files_at(params["repo"], params["rev"])
        if files is None:
            return
        prefix = params.get("path", "")
        entries = [
            {"type": "file", "oid": git_blob_id(c), "size": len(c), "path": p}
            for p, c in sorted(files.items())
            if p.startswith(prefix)
        ]
        self.reply(200, entries)

    def preupload(self, params, body, query):
        if self.files_at(params["repo"], params["rev"]) is None:
            return
        files = json.loads(body)["files"]
        self.reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]})

    def commit(self, params, body, query):
        repo, branch = params["repo"], params["rev"]
        if self.files_at(repo, branch) is None:
            return
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = next(x["value"] for x in lines if x["key"] == "header")
        added = {x["value"]["path"]: base64.b64decode(x["value"]["content"]) for x in lines if x["key"] == "file"}
        deleted = [x["value"]["path"] for x in lines if x["key"] in ("deletedFile", "deletedFolder")]
        if any(x["key"] == "lfsFile" for x in lines):  # every file was announced "regular": LFS is a client bug here
            return self.reply(400, {"error": "unexpected lfsFile"})
        with self.state.lock:
            files = self.state.repos[repo][branch]
            for path in deleted:
                files.pop(path, None)
            files.update(added)
            oid = hashlib.sha1(f"{repo}{branch}{len(self.state.commits)}".encode()).hexdigest()
            self.state.heads[(repo, branch)] = oid
            self.state.commits.append(
                {"repo": repo, "revision": branch, "message": header["summary"], "files": added, "deleted": deleted}
            )
        self.reply(200, {"commitUrl": f"{self.url(repo)}/commit/{oid}", "commitOid": oid})

    def validate_yaml(self, params, body, query):
        self.reply(200, {"errors": [], "warnings": []})

    # --- helpers ---

    def files_at(self, repo, revision):
        """The files of a branch, or None after answering 404 as the Hub does."""
        branches = self.state.repos.get(repo)
        if branches is None:
            self.reply(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            return None
        if revision not in branches:
            self.reply(404, {"error": f"Invalid rev id: {revision}"}, {"X-Error-Code": "RevisionNotFound"})
            return None
        return branches[revision]

    def url(self, repo):
        return f"http://{self.headers.get('Host')}/{repo}"

    def reply(self, status, body, headers=None):
        payload = json.dumps(body).encode()
        self.send_response(status)
        for k, v in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


class StandInHub:
    """The server on a free local port, in a thread; `endpoint` is what HF_ENDPOINT / constants.ENDPOINT take."""

    def __init__(self):
        self.state = HubState()
        handler = type("BoundHandler", (Handler,), {"state": self.state})
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
