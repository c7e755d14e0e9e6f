"""The GitHub story: the run's repository over the same months, as webhook deliveries.

Issues, PRs with reviews and synchronize pushes, squash merges pushed to main (each config change's
PR among them), crash reports and relaunch comments on the run's status issue; every attempt runs
the commit at the head of main when it launched. The deliveries become envelopes through
``runledger.ingest.github_events.webhook_events``, as the receiver makes them.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runledger.ingest.github_events import webhook_events
from runledger.schemas import Envelope
from runledger.workflows.simulate.facts import BOT, CLUSTER, USERS, when
from runledger.workflows.simulate.timeline import Change, Plan, Segment

DAY = 86400.0
Delivery = tuple[float, str, dict[str, Any]]  # (seconds since START, event name, payload)


@dataclass
class _Pr:
    open_s: float
    close_s: float
    merged: bool
    title: str
    author: str
    merger: str
    branch: str
    body: str
    labels: list[str]
    head_shas: list[tuple[float, str]]  # (time, head) — the first is the head it was opened with
    merge_sha: str
    reviews: list[tuple[float, str, str, str]]  # (time, reviewer, state, body)
    files: int
    number: int = 0


@dataclass
class _Issue:
    open_s: float
    close_s: float | None
    title: str
    author: str
    labels: list[str]
    body: str
    comments: list[tuple[float, str, str]]  # (time, author, body)
    number: int = 0


_ROUTINE_PRS = (
    "Add per-layer drop-rate panels to the run dashboard",
    "Eval harness: add the long-context needle suite",
    "Tokenizer: handle NFKC edge cases in the code shards",
    "Checkpoint: write shards with 8 parallel uploads",
    "Fix the data loader's resume offset after a preemption",
    "Log the expert-bias norm per layer",
    "CI: run the MoE unit tests on GB200 nightly",
    "Docs: how to relaunch the run from a checkpoint",
    "Data: dedupe the web shards against the eval sets",
    "Profiler: capture all-to-all timelines every 5,000 steps",
    "Speed up the router's top-k with a fused kernel",
    "Recipe: record the resolved config in every relaunch comment",
    "Monitoring: alert when MFU drops below 20% for 10 minutes",
    "Refactor the pooled-wave buffer sizing into one function",
    "Add a script to compare the recorded config with a new one",
    "Bump the container to CUDA 12.9 and NCCL 2.27",
    "Evals: add MMLU-Pro and GPQA to the 2,000-step suite",
    "Make the status file record every attempt, not only the latest",
)
_EXPERIMENTS = (
    "Experiment: capacity factor 1.15 vs 1.25 for pooled-wave (2.67% drops is near the 3% goal)",
    "Experiment: ragged all-to-all on one rack (drops and MFU)",
    "Experiment: z-loss coefficient sweep on the 8B proxy",
    "Experiment: midtrain mixture ablations on the 8B proxy",
    "Experiment: expert-bias update rate 1e-3 vs 5e-4",
    "Experiment: long-context extension recipe for the last 7% of tokens",
    "Experiment: MFU with 3 vs 4 waves",
    "Question: how often did the cluster fail this month?",
)
_FIX_TITLES = {
    "nccl": "Raise the NCCL watchdog timeout to 30 min and log the stuck collective",
    "oom": "Cap the dispatcher's receive buffers to avoid an OOM on long-tail batches",
    "nonfinite": "Skip the corrupt shard and guard the router logits against NaN",
    "xid": "Drain {host} and add it to the node blocklist",
    "ecc": "Drain {host} and add it to the node blocklist",
}


class _Ids:
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.comment = 2_610_000_000

    def sha(self) -> str:
        return self.rng.bytes(20).hex()

    def delivery(self) -> str:
        return str(uuid.UUID(bytes=self.rng.bytes(16), version=4))

    def next_comment(self) -> int:
        self.comment += int(self.rng.integers(1, 9000))
        return self.comment


@dataclass
class _GitHub:
    """The GitHub story being laid out: its draws, its ids, and the PRs and issues so far."""

    story: Plan
    rng: np.random.Generator
    ids: _Ids
    prs: list[_Pr] = field(default_factory=list)
    issues: list[_Issue] = field(default_factory=list)

    def people(self, k: int, avoid: str = "") -> list[str]:
        pool = [u for u in USERS if u != avoid]
        return [pool[i] for i in self.rng.choice(len(pool), size=k, replace=False)]

    def pr(self, open_s: float, merge_s: float, title: str, labels: list[str], *, merged: bool = True) -> _Pr:
        """A PR opened at ``open_s`` and closed (merged, unless not) at ``merge_s``, with its reviews."""
        rng, ids = self.rng, self.ids
        author, merger = self.people(2)
        slug = "-".join(title.lower().replace(":", "").split()[:5])
        heads = [(open_s, ids.sha())]
        if rng.random() < 0.4:  # pushed again during review
            heads.append((open_s + (merge_s - open_s) * float(rng.uniform(0.2, 0.6)), ids.sha()))
        reviews = []
        for who in self.people(int(rng.integers(1, 3)), author):
            t = open_s + (merge_s - open_s) * float(rng.uniform(0.3, 0.9))
            state = "approved" if merged or rng.random() < 0.3 else "changes_requested"
            reviews.append((t, who, state, "LGTM" if state == "approved" else "Please split this up."))
        reviews.sort()
        made = _Pr(
            open_s,
            merge_s,
            merged,
            title,
            author,
            merger,
            f"{author}/{slug}",
            f"{title}.\n\nPart of the {self.story.options.run_id} run.",
            labels,
            heads,
            ids.sha(),
            reviews,
            int(rng.integers(1, 40)),
        )
        self.prs.append(made)
        return made


def lay_out_github(story: Plan, rng: np.random.Generator) -> None:
    """Issues, PRs, reviews, pushes and comments over the run's months; attempts get their commits."""
    gh = _GitHub(story, rng, _Ids(np.random.default_rng([story.options.seed, 4, *story.options.github_salt])))
    end_s = _end_of(story.segments[-1])

    # PRs: the launch config, the new dispatcher, one per config change, crash fixes, routine work.
    launch = _launch_prs(gh)
    change_prs = _change_prs(gh)
    fixes = _fix_prs(gh)
    _routine_prs(gh, end_s)

    # Attempts run the head of main when they launch; attempt 1 runs the launch PR's merge.
    head_at = _main_history(gh)
    _assign_commits(story, head_at)
    assert story.segments[0].git_commit == launch.merge_sha

    # Issues: the run's status issue with a comment per relaunch, a report per crash, experiments.
    _status_and_crash_issues(gh, fixes, end_s)
    _experiment_issues(gh, end_s)

    # Numbers in the order things were opened, as GitHub assigns them; the changes name their PRs.
    things: list[_Pr | _Issue] = sorted([*gh.prs, *gh.issues], key=lambda x: x.open_s)
    for number, thing in enumerate(things, start=story.options.first_number):
        thing.number = number
    for change, made in change_prs:
        change.pr = made.number

    # Every delivery in time order, made into envelopes as the webhook receiver makes them.
    story.github = _envelopes(gh, head_at)


def _end_of(seg: Segment) -> float:
    """When the attempt's last step ended (its launch if it ran none), seconds since START."""
    return float(seg.wall_s[-1]) if seg.wall_s.size else seg.launch_time_s


def _time_of(story: Plan, step: int) -> float:
    """When ``step`` first ended (seconds since START)."""
    for seg in story.segments:
        if seg.start_step < step <= seg.end_step:
            return float(seg.wall_s[step - seg.start_step - 1])
    return 0.0


def _launch_prs(gh: _GitHub) -> _Pr:
    """The run's launch config (merged the day before the run starts) and the ragged dispatcher's
    code, merged well before the switch turns it on; returns the launch PR."""
    story = gh.story
    launch = gh.pr(
        -6 * DAY,
        -1 * DAY,
        f"Launch config for the 535B-A23B pre-training run ({story.options.run_id})",
        ["run"],
    )
    switch_time = _time_of(story, story.switch_step)
    gh.pr(
        switch_time - 20 * DAY,
        switch_time - 9 * DAY,
        "Add a ragged all-to-all MoE dispatcher (off by default)",
        ["moe", "performance"],
    )
    return launch


def _change_prs(gh: _GitHub) -> list[tuple[Change, _Pr]]:
    """One PR per config change, merged shortly before the change (after the attempt it lands in
    launched); the change records the merge commit and who merged it."""
    story, rng = gh.story, gh.rng
    change_prs: list[tuple[Change, _Pr]] = []
    for change in story.changes:
        t = _time_of(story, change.step)
        previous_launch = max((s.launch_time_s for s in story.segments if s.launch_time_s < t), default=0.0)
        merge_s = max(previous_launch + 60.0, t - float(rng.uniform(600, 3600)))
        made = gh.pr(merge_s - float(rng.uniform(0.5, 3.0)) * DAY, merge_s, change.title, ["config", "run"])
        change.sha, change.author = made.merge_sha, made.merger
        change_prs.append((change, made))
    return change_prs


def _fix_prs(gh: _GitHub) -> dict[int, _Pr]:
    """A fix for most crashes with a known cause, opened hours after it; by the crashed attempt."""
    rng = gh.rng
    fixes: dict[int, _Pr] = {}
    for seg in gh.story.segments:
        crash = seg.crash
        if crash is None:
            continue
        t = _end_of(seg)
        if crash.cause in _FIX_TITLES and rng.random() < 0.6:
            title = _FIX_TITLES[crash.cause].format(host=crash.host)
            opened = t + float(rng.uniform(1, 4)) * 3600
            fixes[seg.attempt] = gh.pr(
                opened, opened + float(rng.uniform(0.5, 2.0)) * DAY, title, ["fix", "infra"]
            )
    return fixes


def _routine_prs(gh: _GitHub, end_s: float) -> None:
    """Three rounds of the routine PRs (most merged) at random over the run."""
    rng = gh.rng
    for i, title in enumerate(_ROUTINE_PRS * 3):
        opened = float(rng.uniform(0.0, end_s - DAY))  # after the launch PR: attempt 1 runs its merge
        merged = rng.random() < 0.85
        gh.pr(
            opened,
            opened + float(rng.uniform(0.2, 4.0)) * DAY,
            title if i < len(_ROUTINE_PRS) else f"{title} (follow-up {i // len(_ROUTINE_PRS)})",
            ["chore"],
            merged=merged,
        )


def _main_history(gh: _GitHub) -> Callable[[float], str]:
    """The head of main at any moment: a root commit, then each merged PR's squash commit."""
    merges = sorted((p_.close_s, p_.merge_sha) for p_ in gh.prs if p_.merged)
    root = gh.ids.sha()

    def head_at(t: float) -> str:
        head = root
        for when_s, sha in merges:
            if when_s > t:
                break
            head = sha
        return head

    return head_at


def _assign_commits(story: Plan, head_at: Callable[[float], str]) -> None:
    """Each attempt's commit (the head of main at its launch) and its scheduler job."""
    job_rng = np.random.default_rng([story.options.seed, 5])
    job = 4_180_000
    for seg in story.segments:
        seg.git_commit = head_at(seg.launch_time_s)
        job += int(job_rng.integers(50, 3000))
        seg.job_id = f"slurm-{job}"


def _status_and_crash_issues(gh: _GitHub, fixes: dict[int, _Pr], end_s: float) -> None:
    """The status issue (a bot comment per relaunch, one on the dispatcher switch) and a report per
    crash, closed once its fix merged (or the next attempt launched)."""
    story, rng, people = gh.story, gh.rng, gh.people
    segments = story.segments
    status = _Issue(
        -2 * DAY,
        end_s + 3600,
        f"Run status: {story.options.run_id} (535B-A23B MoE on 792 GB200)",
        "lena-m",
        ["run", "status"],
        "Live status of the run. Relaunches are posted here.",
        [],
    )
    gh.issues.append(status)
    for seg in segments[1:]:
        prev = segments[seg.attempt - 2].crash
        assert prev is not None
        status.comments.append(
            (
                seg.launch_time_s + float(rng.uniform(300, 1800)),
                BOT,
                f"Relaunched as attempt {seg.attempt} from checkpoint step {seg.start_step:,} at commit "
                f"{seg.git_commit[:12]} (job {seg.job_id}, cluster {CLUSTER}, tree clean). Previous attempt: "
                f"{prev.kind} after step {prev.step:,} on rank {prev.rank} ({prev.host}).",
            )
        )
        t_crash = float(segments[seg.attempt - 2].wall_s[-1])
        fix = fixes.get(seg.attempt - 1)
        gh.issues.append(
            _Issue(
                t_crash + float(rng.uniform(600, 2400)),
                (fix.close_s if fix else seg.launch_time_s) + float(rng.uniform(600, 6 * 3600)),
                f"Crash after step {prev.step:,}: {prev.kind} on {prev.host}",
                people(1)[0],
                ["crash", prev.kind],
                f"{prev.exc_type or prev.kind}: {prev.message}\n\nrank {prev.rank}, host {prev.host}",
                [
                    (
                        t_crash + float(rng.uniform(3000, 9000)),
                        people(1)[0],
                        "Looking into it; relaunching from the last checkpoint.",
                    )
                ],
            )
        )
    status.comments.append(
        (
            _time_of(story, story.switch_step) + 900,
            "sofia-r",
            f"Switched the dispatcher to ragged all-to-all at step {story.switch_step:,}: drops go from ~2.67% to ~0.02%.",
        )
    )


def _experiment_issues(gh: _GitHub, end_s: float) -> None:
    """The experiments and questions, each with a few results comments, closed days later."""
    rng = gh.rng
    for title in _EXPERIMENTS:
        opened = float(rng.uniform(-3 * DAY, end_s - 3 * DAY))
        author = gh.people(1)[0]
        comments = [
            (opened + float(rng.uniform(0.1, 5.0)) * DAY, who, "Results attached; see the W&B report.")
            for who in gh.people(int(rng.integers(1, 4)), author)
        ]
        gh.issues.append(
            _Issue(
                opened,
                opened + float(rng.uniform(3, 14)) * DAY,
                title,
                author,
                ["experiment"],
                f"{title}.",
                sorted(comments),
            )
        )


def _envelopes(gh: _GitHub, head_at: Callable[[float], str]) -> list[tuple[float, list[Envelope]]]:
    """Every PR's and issue's deliveries in time order, each as the receiver's envelopes."""
    repo = gh.story.options.repository
    repository = {"full_name": repo, "name": repo.split("/")[1], "owner": {"login": repo.split("/")[0]}}
    deliveries: list[Delivery] = []
    for p_ in gh.prs:
        deliveries.extend(_pr_deliveries(p_, repo, repository, head_at(p_.open_s)))
    for issue in gh.issues:
        deliveries.extend(_issue_deliveries(issue, repo, repository, gh.ids))
    deliveries.sort(key=lambda d: d[0])
    return [
        (t, webhook_events(event, payload, received_at=when(t), delivery=gh.ids.delivery()))
        for t, event, payload in deliveries
    ]


def _iso(t: float) -> str:
    return when(t).strftime("%Y-%m-%dT%H:%M:%SZ")


def _user(login: str) -> dict[str, Any]:
    return {"login": login, "type": "Bot" if login == BOT else "User"}


# --- deliveries -----------------------------------------------------------------------------------


def _pr_deliveries(p_: _Pr, repo: str, repository: dict[str, Any], base_sha: str) -> list[Delivery]:
    """A PR's deliveries: opened, each push to its branch, its reviews, closed, and a merge's push."""
    hook = _PrHook(p_, repo, repository, base_sha)
    # Opened with its first head, then pushed to during review.
    out = [hook.opened()]
    head = p_.head_shas[0][1]
    for t, sha in p_.head_shas[1:]:
        out.append(hook.synchronize(t, head, sha))
        head = sha
    # Reviews, of the branch's last head.
    out.extend(hook.review(n, review, head) for n, review in enumerate(p_.reviews))
    # Closed by its merger (or its author); a squash merge is one commit pushed to main.
    out.append(hook.closed(head))
    if p_.merged:
        out.append(hook.merge_push())
    return out


@dataclass(frozen=True)
class _PrHook:
    """One PR's webhook payloads: its ``pull_request`` object at any moment, and each delivery."""

    pr: _Pr
    repo: str
    repository: dict[str, Any]
    base_sha: str

    @property
    def url(self) -> str:
        return f"https://github.com/{self.repo}/pull/{self.pr.number}"

    def obj(self, t: float, head: str, *, closed: bool = False) -> dict[str, Any]:
        p_ = self.pr
        merged = closed and p_.merged
        return {
            "number": p_.number,
            "title": p_.title,
            "state": "closed" if closed else "open",
            "user": _user(p_.author),
            "merged": merged,
            "merge_commit_sha": p_.merge_sha if merged else None,
            "head": {"sha": head, "ref": p_.branch},
            "base": {"sha": self.base_sha, "ref": "main"},
            "labels": [{"name": label} for label in p_.labels],
            "body": p_.body,
            "html_url": self.url,
            "created_at": _iso(p_.open_s),
            "updated_at": _iso(t),
            "merged_at": _iso(p_.close_s) if merged else None,
            "closed_at": _iso(p_.close_s) if closed else None,
            "draft": False,
            "changed_files": p_.files,
        }

    def opened(self) -> Delivery:
        p_ = self.pr
        payload = {
            "action": "opened",
            "number": p_.number,
            "pull_request": self.obj(p_.open_s, p_.head_shas[0][1]),
            "repository": self.repository,
            "sender": _user(p_.author),
        }
        return p_.open_s, "pull_request", payload

    def synchronize(self, t: float, before: str, after: str) -> Delivery:
        payload = {
            "action": "synchronize",
            "number": self.pr.number,
            "before": before,
            "after": after,
            "pull_request": self.obj(t, after),
            "repository": self.repository,
            "sender": _user(self.pr.author),
        }
        return t, "pull_request", payload

    def review(self, n: int, review: tuple[float, str, str, str], head: str) -> Delivery:
        t, who, state, body = review
        review_id = 2_140_000_000 + self.pr.number * 10 + n
        payload = {
            "action": "submitted",
            "review": {
                "id": review_id,
                "user": _user(who),
                "body": body,
                "commit_id": head,
                "submitted_at": _iso(t),
                "state": state,
                "html_url": f"{self.url}#pullrequestreview-{review_id}",
            },
            "pull_request": self.obj(t, head),
            "repository": self.repository,
            "sender": _user(who),
        }
        return t, "pull_request_review", payload

    def closed(self, head: str) -> Delivery:
        p_ = self.pr
        payload = {
            "action": "closed",
            "number": p_.number,
            "pull_request": self.obj(p_.close_s, head, closed=True),
            "repository": self.repository,
            "sender": _user(p_.merger if p_.merged else p_.author),
        }
        return p_.close_s, "pull_request", payload

    def merge_push(self) -> Delivery:
        p_ = self.pr
        commit = {
            "id": p_.merge_sha,
            "message": f"{p_.title} (#{p_.number})",
            "timestamp": _iso(p_.close_s),
            "author": {"name": p_.author, "username": p_.author},
            "url": f"https://github.com/{self.repo}/commit/{p_.merge_sha}",
        }
        payload = {
            "ref": "refs/heads/main",
            "before": self.base_sha,
            "after": p_.merge_sha,
            "created": False,
            "deleted": False,
            "forced": False,
            "repository": {**self.repository, "pushed_at": int(when(p_.close_s + 1).timestamp())},
            "pusher": {"name": p_.merger},
            "sender": _user(p_.merger),
            "head_commit": commit,
            "commits": [commit],
        }
        return p_.close_s + 1, "push", payload


def _issue_deliveries(issue: _Issue, repo: str, repository: dict[str, Any], ids: _Ids) -> list[Delivery]:
    """An issue's deliveries: opened, each comment (with its id), and closed unless still open."""
    url = f"https://github.com/{repo}/issues/{issue.number}"

    def obj(t: float, *, closed: bool = False) -> dict[str, Any]:
        return {
            "number": issue.number,
            "title": issue.title,
            "state": "closed" if closed else "open",
            "user": _user(issue.author),
            "labels": [{"name": label} for label in issue.labels],
            "body": issue.body,
            "html_url": url,
            "created_at": _iso(issue.open_s),
            "updated_at": _iso(t),
            "closed_at": _iso(issue.close_s) if closed and issue.close_s is not None else None,
        }

    def delivery(t: float, event: str, action: str, who: str, **extra: Any) -> Delivery:
        payload = {"action": action, "issue": obj(t, closed=action == "closed"), **extra}
        return t, event, {**payload, "repository": repository, "sender": _user(who)}

    out = [delivery(issue.open_s, "issues", "opened", issue.author)]
    for t, who, body in issue.comments:
        comment_id = ids.next_comment()
        comment = {
            "id": comment_id,
            "user": _user(who),
            "body": body,
            "created_at": _iso(t),
            "updated_at": _iso(t),
            "html_url": f"{url}#issuecomment-{comment_id}",
        }
        out.append(delivery(t, "issue_comment", "created", who, comment=comment))
    if issue.close_s is not None:
        out.append(delivery(issue.close_s, "issues", "closed", issue.author))
    return out
