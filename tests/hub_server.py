"""A local stand-in for the Hugging Face Hub's HTTP API that records every request.

It answers, in the shapes the Hub documents and huggingface_hub 2.4 parses, what this project's push path uses:
whoami, the write auth-check, a model repo's info, repo creation, branches (create, delete, list), a branch's history
(list, super-squash), the tree of a revision, preupload (every file
"regular", so contents travel inside the commit and the stand-in keeps them) and commits (NDJSON), plus validate-yaml
for model cards (refusing one whose metadata sets a key of `card_refusals`). Repos live in memory: {repo: {branch:
{path: bytes}}}. Anything else is answered 404 and recorded, so a test sees a request it did not expect.

Model repos are served for reading as `snapshot_download` (scripts/prefetch.py) reads them: their info and tree at a
branch or commit, and their files (HEAD and GET); a test commits a model with `state.add_model_commit(repo, {path:
bytes}) -> commit id`.

Data set repos are served for reading, as `datasets.load_dataset(repo, revision=...)` and `HfApi().dataset_info` read
them: the repo's info at a revision, its tree, paths-info, and its files (HEAD and GET, byte ranges). A test makes
their history with `state.add_dataset_commit(repo, {path: bytes}, branch="main") -> sha`: each call one commit
holding exactly those files, the branch moving to it and earlier commits staying readable by their sha.
`state.project_requests()` is `state.requests` less the libraries' own (LIBRARY_OWN, TRL's telemetry HEAD).

Faults are injected per (kind, revision): `fail` answers 500 (with `Retry-After: 0`, which huggingface_hub honours
after one second; `fail_status` another status) a number of times (-1: always); `drop` closes the connection without
an answer (a proxy or the network cutting it) as often; `hold` runs a function before answering (to delay an upload
until something happened on disk).
"""

import base64
import hashlib
import http.server
import json
import re
import socket
import sys
import threading
import time
from urllib.parse import parse_qs, unquote, urlparse

import yaml

GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"  # a new repo's first commit
REPO = r"(?P<repo>[^/]+/[^/]+)"
# huggingface_hub fetches a registry of AI-agent harnesses (for its user agent) once a day, and TRL's trainers report
# their use (HEAD /api/telemetry/trl/...) unless HF_HUB_DISABLE_TELEMETRY: the libraries' requests, not the project's.
LIBRARY_OWN = {"/api/agent-harnesses"}
COMMIT_DATE = "2026-01-01T00:00:00.000Z"  # every data set commit's date: nothing here reads it
ROUTES = [
    ("GET", r"/api/whoami-v2", "whoami"),
    ("GET", rf"/api/models/{REPO}/auth-check/write", "auth_check"),
    ("GET", rf"/api/models/{REPO}(?:/revision/(?P<rev>[^/]+))?", "model_info"),
    ("POST", r"/api/repos/create", "create_repo"),
    ("POST", rf"/api/models/{REPO}/branch/(?P<rev>[^/]+)", "create_branch"),
    ("DELETE", rf"/api/models/{REPO}/branch/(?P<rev>[^/]+)", "delete_branch"),
    ("GET", rf"/api/models/{REPO}/refs", "refs"),
    ("GET", rf"/api/models/{REPO}/commits/(?P<rev>[^/]+)", "commits"),
    ("POST", rf"/api/models/{REPO}/super-squash/(?P<rev>[^/]+)", "super_squash"),
    ("GET", rf"/api/models/{REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?", "tree"),
    ("POST", rf"/api/models/{REPO}/preupload/(?P<rev>[^/]+)", "preupload"),
    ("POST", rf"/api/models/{REPO}/commit/(?P<rev>[^/]+)", "commit"),
    ("POST", r"/api/validate-yaml", "validate_yaml"),
    ("HEAD", r"/api/telemetry/.+", "telemetry"),
    ("GET", rf"/api/datasets/{REPO}(?:/revision/(?P<rev>[^/]+))?", "dataset_info"),
    ("GET", rf"/api/datasets/{REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?", "dataset_tree"),
    ("POST", rf"/api/datasets/{REPO}/paths-info/(?P<rev>[^/]+)", "dataset_paths_info"),
    ("HEAD", rf"/datasets/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "dataset_file"),
    ("GET", rf"/datasets/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "dataset_file"),
    ("HEAD", rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "model_file"),
    ("GET", rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "model_file"),
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


def tree_entries(files: dict[str, bytes]) -> list[dict]:
    """Every file and folder of a tree, as the tree and paths-info endpoints list them."""
    folders = {"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)}
    entries = [
        {"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d} for d in folders
    ]
    entries += [{"type": "file", "oid": git_blob_id(c), "size": len(c), "path": p} for p, c in files.items()]
    return sorted(entries, key=lambda e: e["path"])


def model_entry(path: str, content: bytes) -> dict:
    """A model repo's file as the Hub's tree lists it: *.safetensors kept in LFS (the Hub's .gitattributes), listed
    with their SHA-256 and the blob id of their pointer; the others as git blobs."""
    entry = {"type": "file", "oid": git_blob_id(content), "size": len(content), "path": path}
    if not path.endswith(".safetensors"):
        return entry
    sha256 = hashlib.sha256(content).hexdigest()
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(content)}\n".encode()
    return {**entry, "oid": git_blob_id(pointer), "lfs": {"oid": sha256, "size": len(content), "pointerSize": 134}}


def in_folder(path: str, folder: str, recursive: bool) -> bool:
    """Whether `path` is listed under `folder` ("" for the root): its children, or with `recursive` everything in it."""
    if folder and not path.startswith(f"{folder}/"):
        return False
    return recursive or "/" not in (path[len(folder) + 1 :] if folder else path)


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """[start, end) of a `Range: bytes=a-b` (or `bytes=-n`, the last n bytes) header; None for no range."""
    ranged = re.fullmatch(r"bytes=(\d*)-(\d*)", header or "")
    if not ranged or not size or ranged.groups() == ("", ""):
        return None
    first, last = ranged.groups()
    if not first:
        return max(size - int(last), 0), size
    return int(first), min(int(last) + 1 if last else size, size)


def card_data(files: dict[str, bytes]) -> dict:
    """The YAML header of the repo's README.md, which the Hub returns as `cardData` ({} without one)."""
    found = re.match(rb"---\n(.*?)\n---\n", files.get("README.md", b""), re.DOTALL)
    return (yaml.safe_load(found.group(1)) or {}) if found else {}


def flag(query: dict[str, list[str]], name: str) -> bool:
    """A boolean query or form field as huggingface_hub sends it ("true"/"false", "True"/"False")."""
    return query.get(name, ["false"])[0].lower() in ("1", "true")


def with_commit(entry: dict, sha: str) -> dict:
    """An entry with the `lastCommit` that `expand` asks for (every path's last commit is the one asked about)."""
    return {**entry, "lastCommit": {"id": sha, "title": "Upload data", "date": COMMIT_DATE}}


class HubState:
    """What the stand-in knows and saw; tests read and set it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: list[dict] = []  # every request: method, kind, path, query, repo, revision, auth, range, time
        self.commits: list[dict] = []  # every accepted commit: repo, revision, message, files {path: bytes}, deleted
        self.repos: dict[str, dict[str, dict[str, bytes]]] = {}
        self.heads: dict[tuple[str, str], str] = {}  # (repo, branch) -> commit id
        # commit id -> (parent id, title, files): what a branch created at that commit starts with, and main's history
        self.snapshots: dict[str, tuple[str | None, str, dict[str, bytes]]] = {}
        self.whoami = whoami_answer(orgs=[("lab", "contributor")])
        self.whoami_status = 200
        # repo -> status of its write auth-check (default: 200 if it exists, else 404). An existing repo the token may
        # not write to is answered 403, or 404 as if it did not exist (huggingface_hub's own `hf spaces hot-reload`
        # reads a failed write check as RepositoryNotFoundError).
        self.auth_status: dict[str, int] = {}
        # namespace -> status of a repo creation there (default 200): 403 where this token may not create repos, as
        # the Hub answers a read token or another user's namespace.
        self.create_status: dict[str, int] = {}
        # repo -> the visibility its creation asked for ("public", "private"; None: the namespace's default)
        self.visibility: dict[str, str | None] = {}
        self.fail: dict[tuple[str, str], int] = {}  # (kind, revision) -> failures left (-1: always)
        # What a fault answers. 500 is transient: huggingface_hub sleeps a second before each of its 5 retries, and the
        # project tries once more, ~10 s a failed push. 400 neither retries: for a test of what a failed upload leaves.
        self.fail_status = 500
        self.fail_error: str | None = None  # the fault's error text, the Hub's reason (its JSON `error`); None: generic
        self.drop: dict[tuple[str, str], int] = {}  # (kind, revision) -> connections closed unanswered (-1: always)
        self.hold: dict[tuple[str, str], object] = {}  # (kind, revision) -> fn() run before answering
        # metadata key -> the Hub's reason for refusing a model card whose YAML block sets it (validate-yaml's 400, as
        # the Hub refuses `license: Apache 2.0`); every other card is valid
        self.card_refusals: dict[str, str] = {}
        self.dataset_commits: dict[str, dict[str, dict[str, bytes]]] = {}  # data set repo -> {sha: {path: bytes}}
        self.dataset_heads: dict[tuple[str, str], str] = {}  # (data set repo, branch) -> sha

    def add_dataset_commit(self, repo: str, files: dict[str, bytes], branch: str = "main") -> str:
        """A new commit on data set `repo`'s `branch` holding exactly `files` (the whole tree, {path: bytes}); the
        branch's head moves to it, earlier commits stay readable by their sha. Returns the commit's sha."""
        with self.lock:
            commits = self.dataset_commits.setdefault(repo, {})
            parent = self.dataset_heads.get((repo, branch), "")
            tree = {path: git_blob_id(content) for path, content in sorted(files.items())}
            sha = hashlib.sha1(json.dumps([repo, branch, parent, len(commits), tree]).encode()).hexdigest()
            commits[sha] = dict(files)
            self.dataset_heads[(repo, branch)] = sha
        return sha

    def add_repo(self, repo: str) -> bool:
        """A new model repo `repo` ("namespace/name"), as the Hub creates it: a main branch with .gitattributes. False
        if it exists already."""
        with self.lock:
            if repo in self.repos:
                return False
            self.repos[repo] = {"main": {".gitattributes": GITATTRIBUTES}}
            self.heads[(repo, "main")] = hashlib.sha1(repo.encode()).hexdigest()
            self.snapshots[self.heads[(repo, "main")]] = (None, "initial commit", dict(self.repos[repo]["main"]))
        return True

    def add_model_commit(self, repo: str, files: dict[str, bytes]) -> str:
        """A commit on model `repo`'s main (the repo created if new) adding `files` ({path: bytes}), as an upload makes
        one; returns its id. snapshot_download then reads them (`model_file`)."""
        self.add_repo(repo)
        with self.lock:
            main = self.repos[repo]["main"]
            main.update(files)
            oid = hashlib.sha1(f"{repo}main{len(self.snapshots)}".encode()).hexdigest()
            self.snapshots[oid] = (self.heads[(repo, "main")], "Upload model", dict(main))
            self.heads[(repo, "main")] = oid
        return oid

    def dataset_commit(self, repo: str, revision: str) -> str | None:
        """The sha a branch name or a known sha of data set `repo` stands for; None if neither."""
        if revision in self.dataset_commits.get(repo, {}):
            return revision
        return self.dataset_heads.get((repo, revision))

    def of(self, kind: str) -> list[dict]:
        return [r for r in self.requests if r["kind"] == kind]

    def project_requests(self) -> list[dict]:
        """Every request but the libraries' own (LIBRARY_OWN, telemetry)."""
        return [r for r in self.requests if r["path"] not in LIBRARY_OWN and r["kind"] != "telemetry"]


class Handler(http.server.BaseHTTPRequestHandler):
    state: HubState  # set per server

    def do_GET(self):
        self.route("GET")

    def do_POST(self):
        self.route("POST")

    def do_HEAD(self):
        self.route("HEAD")

    def do_DELETE(self):
        self.route("DELETE")

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
            "method": method,
            "kind": kind,
            "path": url.path,
            "query": parse_qs(url.query),
            "repo": params.get("repo"),
            "revision": params.get("rev"),
            "auth": self.headers.get("Authorization"),
            "range": self.headers.get("Range"),
            "time": time.time(),
        }
        with self.state.lock:
            self.state.requests.append(record)
            left = self.state.fail.get((kind, params.get("rev")), 0)
            if left:
                self.state.fail[(kind, params.get("rev"))] = left - 1 if left > 0 else left
            dropped = self.state.drop.get((kind, params.get("rev")), 0)
            if dropped:
                self.state.drop[(kind, params.get("rev"))] = dropped - 1 if dropped > 0 else dropped
        if dropped:  # the client reads "Server disconnected without sending a response"
            self.close_connection = True
            return self.connection.shutdown(socket.SHUT_RDWR)
        hold = self.state.hold.get((kind, params.get("rev")))
        if hold:
            hold()
        if left:
            status = self.state.fail_status
            error = "Internal Error - We're working hard to fix this" if status >= 500 else "Bad request"
            error = self.state.fail_error or error
            return self.reply(status, {"error": error}, {"Retry-After": "0"})
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
        status = self.state.create_status.get(repo.split("/")[0], 200)
        if status != 200:
            return self.reply(
                status,
                {"error": f'You don\'t have the rights to create a model under the namespace "{repo.split("/")[0]}"'},
            )
        if not self.state.add_repo(repo):
            return self.reply(409, {"error": "You already created this model repo", "url": self.url(repo)})
        self.state.visibility[repo] = payload.get("visibility")
        self.reply(200, {"url": self.url(repo), "name": repo, "id": repo})

    def model_info(self, params, body, query):
        """What HfApi.repo_info / repo_exists read of a model repo (its id, head, files) at a branch (main unless
        given); 404 if there is none."""
        branch = params.get("rev", "main")
        files = self.files_at(params["repo"], branch)
        if files is None:
            return
        repo = params["repo"]
        sha = self.state.heads[(repo, branch)]
        self.reply(
            200,
            {
                "_id": sha[:24],
                "id": repo,
                "author": repo.split("/")[0],
                "sha": sha,
                "private": self.state.visibility.get(repo) == "private",
                "gated": False,
                "disabled": False,
                "downloads": 0,
                "likes": 0,
                "tags": [],
                "createdAt": COMMIT_DATE,
                "lastModified": COMMIT_DATE,
                "siblings": [{"rfilename": path} for path in sorted(files)],
            },
        )

    def create_branch(self, params, body, query):
        repo, branch = params["repo"], params["rev"]
        with self.state.lock:
            branches = self.state.repos.get(repo)
            if branches is None:
                return self.reply(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            if branch in branches:
                return self.reply(409, {"error": "Reference already exists"})
            start = json.loads(body or b"{}").get("startingPoint") or self.state.heads[(repo, "main")]
            if start not in self.state.snapshots:
                return self.reply(404, {"error": f"Invalid rev id: {start}"}, {"X-Error-Code": "RevisionNotFound"})
            branches[branch] = dict(self.state.snapshots[start][2])
            self.state.heads[(repo, branch)] = start
        self.reply(200, {})

    def delete_branch(self, params, body, query):
        repo, branch = params["repo"], params["rev"]
        if self.files_at(repo, branch) is None:
            return
        with self.state.lock:
            del self.state.repos[repo][branch], self.state.heads[(repo, branch)]
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

    def commits(self, params, body, query):
        """A branch's history, newest first (one page)."""
        if self.files_at(params["repo"], params["rev"]) is None:
            return
        history, oid = [], self.state.heads[(params["repo"], params["rev"])]
        while oid is not None:
            parent, title, _ = self.state.snapshots[oid]
            history.append({"id": oid, "authors": [], "date": COMMIT_DATE, "title": title, "message": ""})
            oid = parent
        self.reply(200, history)

    def super_squash(self, params, body, query):
        """HfApi.super_squash_history: the branch's history becomes one commit holding its files."""
        repo, branch = params["repo"], params["rev"]
        files = self.files_at(repo, branch)
        if files is None:
            return
        with self.state.lock:
            oid = hashlib.sha1(f"{repo}{branch}squash{len(self.state.snapshots)}".encode()).hexdigest()
            self.state.snapshots[oid] = (None, json.loads(body)["message"], dict(files))
            self.state.heads[(repo, branch)] = oid
        self.reply(200, {})

    def tree(self, params, body, query):
        found = self.model_at(params["repo"], params["rev"])
        if found is None:
            return
        files = found[1]
        prefix = params.get("path", "")
        self.reply(200, [model_entry(p, c) for p, c in sorted(files.items()) if p.startswith(prefix)])

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
            self.state.snapshots[oid] = (self.state.heads[(repo, branch)], header["summary"], dict(files))
            self.state.heads[(repo, branch)] = oid
            self.state.commits.append(
                {"repo": repo, "revision": branch, "message": header["summary"], "files": added, "deleted": deleted}
            )
        self.reply(200, {"commitUrl": f"{self.url(repo)}/commit/{oid}", "commitOid": oid})

    def validate_yaml(self, params, body, query):
        content = json.loads(body)["content"]
        head = content.split("\n---", 1)[0].removeprefix("---\n") if content.startswith("---\n") else ""
        metadata = yaml.safe_load(head) or {}
        errors = [{"message": why} for key, why in self.state.card_refusals.items() if key in metadata]
        self.reply(400 if errors else 200, {"errors": errors, "warnings": []})

    def telemetry(self, params, body, query):
        self.reply(200, {})

    # --- data sets, read-only ---

    def dataset_info(self, params, body, query):
        found = self.dataset_at(params["repo"], params.get("rev", "main"))
        if found is None:
            return
        sha, files = found
        self.reply(
            200,
            {
                "_id": sha[:24],
                "id": params["repo"],
                "author": params["repo"].split("/")[0],
                "sha": sha,
                "private": False,
                "gated": False,
                "disabled": False,
                "downloads": 0,
                "likes": 0,
                "tags": [],
                "cardData": card_data(files),
                "createdAt": COMMIT_DATE,
                "lastModified": COMMIT_DATE,
                "siblings": [{"rfilename": path} for path in sorted(files)],
            },
        )

    def dataset_tree(self, params, body, query):
        found = self.dataset_at(params["repo"], params["rev"])
        if found is None:
            return
        sha, files = found
        folder = params.get("path", "").strip("/")
        if folder and folder in files or folder and not any(p.startswith(f"{folder}/") for p in files):
            return self.reply(404, {"error": f"{folder} is not a folder"}, {"X-Error-Code": "EntryNotFound"})
        entries = [e for e in tree_entries(files) if in_folder(e["path"], folder, flag(query, "recursive"))]
        self.reply(200, [with_commit(e, sha) if flag(query, "expand") else e for e in entries])

    def dataset_paths_info(self, params, body, query):
        found = self.dataset_at(params["repo"], params["rev"])
        if found is None:
            return
        sha, files = found
        form = parse_qs(body.decode())
        wanted = {path.strip("/") for path in form.get("paths", [])}
        entries = [e for e in tree_entries(files) if e["path"] in wanted]
        self.reply(200, [with_commit(e, sha) if flag(form, "expand") else e for e in entries])

    def dataset_file(self, params, body, query):
        """A file as /resolve/ serves one kept in git (no LFS, no Xet): the headers hf_hub_download reads, and
        a byte range when asked for one."""
        self.send_file(self.dataset_at(params["repo"], params["rev"]), params["path"])

    def model_file(self, params, body, query):
        """A model repo's file at a branch or commit id, served as a data set's (`dataset_file`): what
        snapshot_download reads."""
        self.send_file(self.model_at(params["repo"], params["rev"]), params["path"])

    def send_file(self, found, path):
        if found is None:
            return
        sha, files = found
        content = files.get(path)
        if content is None:
            headers = {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha}
            return self.reply(404, {"error": f"Entry not found: {path}"}, headers)
        headers = {"X-Repo-Commit": sha, "ETag": f'"{git_blob_id(content)}"', "Accept-Ranges": "bytes"}
        span = byte_range(self.headers.get("Range"), len(content))
        status, (start, end) = (206, span) if span else (200, (0, len(content)))
        if span:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(content)}"
        self.send(status, content[start:end], {"Content-Type": "application/octet-stream", **headers})

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

    def model_at(self, repo, revision):
        """(commit id, files) of a model repo at a branch or a commit id (snapshot_download reads the commit its
        branch resolved to), or None after answering 404 as the Hub does."""
        if repo in self.state.repos and revision in self.state.snapshots:
            return revision, self.state.snapshots[revision][2]
        files = self.files_at(repo, revision)
        return None if files is None else (self.state.heads[(repo, revision)], files)

    def dataset_at(self, repo, revision):
        """(sha, files) of a data set repo at a branch or sha, or None after answering 404 as the Hub does."""
        if repo not in self.state.dataset_commits:
            self.reply(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            return None
        sha = self.state.dataset_commit(repo, revision)
        if sha is None:
            self.reply(404, {"error": f"Invalid rev id: {revision}"}, {"X-Error-Code": "RevisionNotFound"})
            return None
        return sha, self.state.dataset_commits[repo][sha]

    def url(self, repo):
        return f"http://{self.headers.get('Host')}/{repo}"

    def reply(self, status, body, headers=None):
        self.send(status, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})})

    def send(self, status, payload: bytes, headers: dict):
        """Answer with `payload`; a HEAD request gets its headers (Content-Length included) and no body."""
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def log_message(self, *args):
        pass


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        """A client gone mid-answer (a push killed by a test, by construction) is the test's point, not the server's
        error: its traceback filled the suite's log. Any other error is printed as socketserver does."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class StandInHub:
    """The server on a free local port, in a thread; `endpoint` is what HF_ENDPOINT / constants.ENDPOINT take."""

    def __init__(self):
        self.state = HubState()
        handler = type("BoundHandler", (Handler,), {"state": self.state})
        self.server = _Server(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
