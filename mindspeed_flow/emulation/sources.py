"""Locate the MindSpeed-MM, MindSpeed and Megatron-LM source trees an emulated job runs, and check their commits.

Sources come from flags or the environment (MINDSPEED_MM_HOME, MINDSPEED_HOME, MEGATRON_HOME); none of them is
ever vendored into this repository. A tree's commit is read from git when it is a checkout, else from a
`.source_commit` file (one hash, for trees unpacked with `git archive`). Commits other than the tested ones are
an error unless explicitly allowed, because the patches and the emulation target those exact sources.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

# The commits the emulation layer and the patch set were verified against.
TESTED_COMMITS: dict[str, str] = {
    "MindSpeed-MM": "57069cd55a8ab16d5affe379a2e2c5f0a4d962b9",
    "MindSpeed": "028de58ca629d035185b00ff7d1eb7eff4f7fd48",
    "Megatron-LM": "a845aa7e12b3a117e24c2352b9e3e60bad2e3a17",  # tag core_v0.12.1
}
ENV_VARS: dict[str, str] = {"MindSpeed-MM": "MINDSPEED_MM_HOME", "MindSpeed": "MINDSPEED_HOME",
                            "Megatron-LM": "MEGATRON_HOME"}
# A file that identifies each tree (relative to its root).
MARKERS: dict[str, str] = {"MindSpeed-MM": "mindspeed_mm/__init__.py", "MindSpeed": "mindspeed/megatron_adaptor.py",
                            "Megatron-LM": "megatron/core/package_info.py"}
COMMIT_FILE = ".source_commit"
_FULL_HASH = re.compile(r"[0-9a-f]{40}")


class SourceError(RuntimeError):
    """A source tree is missing, malformed, or at an untested commit."""


@dataclass(frozen=True)
class SourceTree:
    name: str
    root: Path
    commit: str | None  # None when neither git nor a .source_commit file tells

    @property
    def tested(self) -> bool:
        return self.commit == TESTED_COMMITS[self.name]


@dataclass(frozen=True)
class Sources:
    mindspeed_mm: SourceTree
    mindspeed: SourceTree
    megatron: SourceTree

    def trees(self) -> tuple[SourceTree, ...]:
        return (self.mindspeed_mm, self.mindspeed, self.megatron)

    def pythonpath(self) -> list[str]:
        """Import roots: MindSpeed, MindSpeed-MM, and Megatron-LM unless MindSpeed-MM holds a `megatron/` copy."""
        paths = [str(self.mindspeed.root), str(self.mindspeed_mm.root)]
        if self.megatron.root != self.mindspeed_mm.root:
            paths.append(str(self.megatron.root))
        return paths


def read_commit(root: Path) -> str | None:
    stamp = root / COMMIT_FILE
    if stamp.is_file():
        words = stamp.read_text().split()
        if not words or not _FULL_HASH.fullmatch(words[0].lower()):
            found = "it is empty" if not words else f"it holds {words[0][:48]!r}"
            raise SourceError(f"{stamp}: a {COMMIT_FILE} file must hold the full 40-hex commit its tree was archived "
                              f"from (write it with `git -C CHECKOUT rev-parse HEAD > {stamp}`); {found}")
        return words[0].lower()
    if (root / ".git").exists():
        try:
            out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                 timeout=30, check=True)
            return out.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None
    return None


def _tree(name: str, flag_value: str | None, env: dict[str, str]) -> SourceTree | None:
    value = flag_value or env.get(ENV_VARS[name])
    if not value:
        return None
    root = Path(value).expanduser().resolve()
    if not (root / MARKERS[name]).is_file():
        raise SourceError(f"{name} source at {root} (from {'flag' if flag_value else ENV_VARS[name]}) has no "
                          f"{MARKERS[name]}: point it at the root of a {name} checkout")
    return SourceTree(name, root, read_commit(root))


def find_sources(mindspeed_mm_home: str | None = None, mindspeed_home: str | None = None,
                 megatron_home: str | None = None, env: dict[str, str] | None = None) -> Sources:
    """Resolve the three trees (flags win over the environment); raise SourceError naming what is missing."""
    env = dict(os.environ if env is None else env)
    mm = _tree("MindSpeed-MM", mindspeed_mm_home, env)
    ms = _tree("MindSpeed", mindspeed_home, env)
    mg = _tree("Megatron-LM", megatron_home, env)
    if mg is None and mm is not None and (mm.root / MARKERS["Megatron-LM"]).is_file():
        # MindSpeed-MM's install guide copies Megatron's megatron/ into its root.
        mg = SourceTree("Megatron-LM", mm.root, read_commit(mm.root / "megatron") or None)
    missing = [f"{name} (set {ENV_VARS[name]} or --{ENV_VARS[name].lower().replace('_', '-')})"
               for name, tree in (("MindSpeed-MM", mm), ("MindSpeed", ms), ("Megatron-LM", mg)) if tree is None]
    if missing:
        raise SourceError("MindSpeed-MM emulation needs source checkouts of: " + "; ".join(missing) +
                          ". Tested commits: " + ", ".join(f"{k} {v[:10]}" for k, v in TESTED_COMMITS.items()))
    return Sources(mm, ms, mg)


def check_commits(sources: Sources, allow_untested: bool = False) -> list[str]:
    """Return warnings for unknown commits; raise SourceError for untested ones unless allowed."""
    warnings, wrong = [], []
    for tree in sources.trees():
        if tree.commit is None:
            warnings.append(f"{tree.name} at {tree.root}: commit unknown (no git, no {COMMIT_FILE}); tested is "
                            f"{TESTED_COMMITS[tree.name]}")
        elif not tree.tested:
            wrong.append(f"{tree.name} at {tree.root} is {tree.commit[:12]}, tested is "
                         f"{TESTED_COMMITS[tree.name][:12]}")
    if wrong and not allow_untested:
        raise SourceError("untested source commits: " + "; ".join(wrong) +
                          " (pass --allow-untested to run anyway; new torch_npu names then show in the emulation log)")
    return warnings + [f"running untested: {w}" for w in wrong]


# --- getting the sources -------------------------------------------------------------------------------------
# Repositories holding the tested commits, tried in order: Ascend's upstream on Gitee, then its GitHub mirror.
# MSF_<NAME>_URL (e.g. MSF_MINDSPEED_MM_URL) replaces the list with one URL, e.g. an internal mirror.
REPO_URLS: dict[str, tuple[str, ...]] = {
    "MindSpeed-MM": ("https://gitee.com/ascend/MindSpeed-MM.git", "https://github.com/Ascend/MindSpeed-MM.git"),
    "MindSpeed": ("https://gitee.com/ascend/MindSpeed.git", "https://github.com/Ascend/MindSpeed.git"),
    "Megatron-LM": ("https://github.com/NVIDIA/Megatron-LM.git",),
}


def repo_urls(name: str) -> tuple[str, ...]:
    override = os.environ.get(f"MSF_{name.upper().replace('-', '_')}_URL")
    return (override,) if override else REPO_URLS[name]


def _git(*args: str, cwd: Path | None = None, timeout: float = 1800) -> None:
    proc = subprocess.run(["git", *args], cwd=None if cwd is None else str(cwd), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise SourceError(f"git {' '.join(args[:3])} ...: {proc.stderr.strip()[-600:]}")


def fetch_tree(name: str, dest: Path) -> SourceTree:
    """git-fetch `name` at its tested commit into `dest` (which must not exist) and stamp its commit."""
    commit = TESTED_COMMITS[name]
    if dest.exists():
        raise SourceError(f"{dest} already exists: not overwriting it (remove it or point {ENV_VARS[name]} at it)")
    dest.mkdir(parents=True)
    _git("init", "-q", str(dest))
    errors = []
    for url in repo_urls(name):
        try:  # one commit, shallow; servers that refuse a fetch by hash get a full fetch instead
            try:
                _git("fetch", "-q", "--depth", "1", url, commit, cwd=dest)
            except SourceError:
                _git("fetch", "-q", url, cwd=dest)
            _git("-c", "advice.detachedHead=false", "checkout", "-q", commit, cwd=dest)
            break
        except SourceError as err:
            errors.append(f"{url}: {err}")
    else:
        raise SourceError(f"{name} at {commit[:12]}: no repository answered ({'; '.join(errors)}); {dest} is left "
                          "as an empty git repository: remove it before trying again")
    (dest / COMMIT_FILE).write_text(commit + "\n")
    return SourceTree(name, dest, read_commit(dest))


def unpack_archive(archive: Path, dest: Path) -> None:
    """Unpack a tar(.gz) holding MindSpeed-MM/, MindSpeed/ and Megatron-LM/ into `dest`, refusing to overwrite."""
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        tops = {m.name.split("/", 1)[0] for m in members}
        if not set(TESTED_COMMITS) <= tops:
            raise SourceError(f"{archive}: expected top-level folders {sorted(TESTED_COMMITS)}, found {sorted(tops)}")
        clash = [t for t in sorted(tops) if (dest / t).exists()]
        if clash:
            raise SourceError(f"{archive}: {', '.join(str(dest / t) for t in clash)} already exist(s): not "
                              "overwriting (remove them, or use the trees already there)")
        dest.mkdir(parents=True, exist_ok=True)
        if hasattr(tarfile, "data_filter"):  # Python >= 3.12 (and patched 3.10/3.11): no links out, no abs paths
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)  # noqa: S202  (members checked above to be the three source folders)


def stamp_commits(root: Path) -> None:
    """Write `.source_commit` for git checkouts under `root` (what `git archive` would lose); never overwrite."""
    for name in TESTED_COMMITS:
        tree = root / name
        if (tree / ".git").exists() and not (tree / COMMIT_FILE).exists():
            commit = read_commit(tree)
            if commit:
                (tree / COMMIT_FILE).write_text(commit + "\n")


def make_archive(root: Path, out: Path) -> Path:
    """tar.gz of the three trees under `root` (without .git), each carrying its `.source_commit`."""
    stamp_commits(root)
    for name in TESTED_COMMITS:
        if read_commit(root / name) is None:
            raise SourceError(f"{root / name}: no {COMMIT_FILE} and not a git checkout; its commit is unknown")
    if out.exists():
        raise SourceError(f"{out} already exists: not overwriting it")
    with tarfile.open(out, "w:gz") as tar:
        for name in TESTED_COMMITS:
            tar.add(root / name, arcname=name, filter=lambda ti: None if ".git" in ti.name.split("/") else ti)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m mindspeed_flow.emulation.sources fetch DEST [--archive OUT.tar.gz]` (what CI runs)."""
    p = argparse.ArgumentParser(prog="python -m mindspeed_flow.emulation.sources",
                                description="git-fetch MindSpeed-MM, MindSpeed and Megatron-LM at the tested commits "
                                            "into DEST/<name>, each with its .source_commit; optionally archive them")
    p.add_argument("action", choices=["fetch"])
    p.add_argument("dest")
    p.add_argument("--archive", default=None, help="also write the three trees (without .git) to this tar.gz")
    args = p.parse_args(argv)
    dest = Path(args.dest).expanduser().resolve()
    try:
        for name in TESTED_COMMITS:
            if (dest / name / MARKERS[name]).is_file() and read_commit(dest / name) == TESTED_COMMITS[name]:
                print(f"{name}: {dest / name} already at {TESTED_COMMITS[name][:12]}")
                continue
            tree = fetch_tree(name, dest / name)
            print(f"{name}: fetched {tree.commit} into {tree.root}")
        if args.archive:
            print(f"archive: {make_archive(dest, Path(args.archive).expanduser().resolve())}")
    except SourceError as err:
        print(f"mindspeed_flow.emulation.sources: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
