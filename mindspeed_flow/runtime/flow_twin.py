"""The flow twin of a user's own MindSpeed-MM launch script (`mindspeed-flow launch-script FLOW.yaml --from X.sh`).

The user's script (the shape of MindSpeed-MM's examples: variable assignments, flag strings, one torchrun line such
as `torchrun $DISTRIBUTED_ARGS pretrain_vlm.py $GPT_ARGS ...`, `torchrun $DISTRIBUTED_ARGS pretrain_transformers.py
${config_path}` or `torchrun $DISTRIBUTED_ARGS mindspeed_mm/fsdp/train/trainer.py CONFIG.yaml`) is rewritten line by
line; every line it has stays as it is unless the plan needs it changed:

- the entry: `torchrun ... -m mindspeed_flow_patches.launch --flow-recipe "$FLOW_RECIPE" <its entry> ...`;
- the launch variables (the ones DISTRIBUTED_ARGS passes as --nproc_per_node, --nnodes, --node_rank, --master_addr,
  --master_port) read the environment first, and ranks per node and nodes are the plan's;
- on the command-line entries (`pretrain_vlm.py`, GLM-4.5V's `pretrain_transformers.py --mm-model ...`), the job's
  TP / PP / CP become the decoder part's where they differ, and the global batch is kept (the user's, or the
  recipe's `trainer.global_batch_size` when it states one) by changing the gradient-accumulation variable, or the
  global-batch one when no whole count gives it; a CONFIG.yaml entry keeps its sizes in that file, which the twin
  does not edit (`job_command` gives the command the launcher will check);
- each node tees its own log (`logs/train_<date>_node<rank>.log` where the script tees `logs/train_<date>.log`);
- added: a header listing what the script reads from the environment (printed by `--help`), and before torchrun a
  block that checks the launch size against the recipe's ranks, that the recipe and the run / save / load folders
  are readable on this node (they must be on storage every node shares), and sets GLOO_SOCKET_IFNAME and
  HCCL_SOCKET_IFNAME from FLOW_SOCKET_IFNAME; the script exits with torchrun's status.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from mindspeed_flow.hosts.mindspeed_mm import FLOW_ENTRY_SCRIPTS
from mindspeed_flow.hosts.mindspeed_mm.entries import is_flow_entry
from mindspeed_flow.hosts.mindspeed_mm.recipe import REFUSED_SCRIPTS
from mindspeed_flow.runtime.shell_words import (ENV_DEFAULT, NAME, Expander, Statement, known, split_words, statements,
                                                strip_comment)

HEADER_END = "# <<< mindspeed-flow header"
BLOCK_START = "# >>> mindspeed-flow: launch checks"
BLOCK_END = "# <<< mindspeed-flow: launch checks"
ENTRY = "-m mindspeed_flow_patches.launch --flow-recipe \"$FLOW_RECIPE\""
# torchrun flag (both spellings) -> role of the variable holding its value
LAUNCH_FLAGS = {"nproc": ("--nproc_per_node", "--nproc-per-node"), "nnodes": ("--nnodes",),
                "node_rank": ("--node_rank", "--node-rank"), "master_addr": ("--master_addr", "--master-addr"),
                "master_port": ("--master_port", "--master-port")}
# variables bash or this script sets itself: never "read from the environment"
_SHELL_OWN = {"PWD", "HOME", "PATH", "HOSTNAME", "RANDOM", "LINENO", "BASH_SOURCE", "PIPESTATUS", "FLOW_STATUS",
              "OLDPWD", "SECONDS", "UID", "USER", "IFS"}


class TwinError(ValueError):
    """The user's script cannot be turned into the recipe's launch (names the variable or flag)."""


@dataclass(frozen=True)
class RecipeLaunch:
    """What the twin needs from the recipe."""
    recipe: Path
    parts: tuple[tuple[str, int, int, int, int], ...]  # (name, dp, tp, pp, cp) in rank order
    global_batch: int | None  # trainer.global_batch_size when the recipe states it
    run_dir: str | None  # the recipe's run_dir when it states one
    per_node: int | None = None  # ranks per node asked for (--npus-per-node, --cluster, the recipe's cluster)

    @property
    def world(self) -> int:
        return sum(dp * tp * pp * cp for _, dp, tp, pp, cp in self.parts)

    def backbone(self) -> tuple[int, int, int, int]:
        name, dp, tp, pp, cp = next(p for p in self.parts if p[0] == "backbone")
        return dp, tp, pp, cp

    def describe(self) -> str:
        return " + ".join(f"{n} {dp * tp * pp * cp}" for n, dp, tp, pp, cp in self.parts)


@dataclass
class Twin:
    text: str
    nnodes: int
    per_node: int
    changed: dict[str, tuple[str, str]] = field(default_factory=dict)  # variable or flag -> (old, new) raw values
    env_vars: dict[str, str] = field(default_factory=dict)  # variable -> what it is (the --help list)
    launch_vars: dict[str, str] = field(default_factory=dict)  # role (nproc, nnodes, node_rank, ...) -> variable

    def node_env(self, node_rank: int = 0) -> dict[str, str]:
        """The environment node `node_rank` launches with (what `job_command` reads the script under)."""
        v = self.launch_vars
        env = {v[k]: str(val) for k, val in (("nproc", self.per_node), ("nnodes", self.nnodes),
                                               ("node_rank", node_rank)) if k in v}
        if "master_addr" in v:
            env[v["master_addr"]] = "localhost"
        return env


@dataclass
class _Script:
    name: str
    lines: list[str]
    stmts: list[Statement]
    launch: Statement  # the torchrun statement
    entry: str = ""  # the entry script's word on the torchrun line, as written
    config_file: bool = False  # the entry reads its sizes from a CONFIG.yaml (the word after it)

    def assignments(self, before: int | None = None) -> list[tuple[Statement, str, str]]:
        out = []
        for s in self.stmts:
            if before is not None and s.start >= before:
                break
            a = s.assignment
            if a:
                out.append((s, a[0], a[1]))
        return out

    def last_assignment(self, name: str) -> tuple[Statement, str] | None:
        found = None
        for s, n, v in self.assignments(self.launch.start):
            if n == name:
                found = (s, v)
        return found

    def flag_value(self, *flags: str) -> tuple[int, str] | None:
        """(physical line, raw value) of the last `--flag value` before the end of the launch statement."""
        found = None
        for idx in range(self.launch.end):
            body = _code(self.lines[idx])
            for flag in flags:
                for m in re.finditer(rf"(?<![\w-]){re.escape(flag)}(?:=|[ \t]+)([^\s\\\"]+)", body):
                    found = (idx, m.group(1))
        return found


def _code(line: str) -> str:
    return line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""


def _var_of(raw: str) -> str | None:
    m = re.fullmatch(rf"\"?\$\{{?({NAME})\}}?\"?", raw)
    return m.group(1) if m else None


def _parse(text: str, name: str, twin: bool = False) -> _Script:
    stmts = statements(text)
    launch = None
    for s in stmts:
        words = split_words(s.text)
        if words[:1] == ["torchrun"] or re.match(r"python[0-9.]*$", words[0] if words else "") and \
                words[1:3] == ["-m", "torch.distributed.run"]:
            launch = s
            break
    if launch is None:
        raise TwinError(f"{name}: no torchrun line (the script must launch one of {', '.join(FLOW_ENTRY_SCRIPTS)} "
                        "with torchrun)")
    if "mindspeed_flow_patches.launch" in launch.text and not twin:
        raise TwinError(f"{name}: its torchrun line already runs mindspeed_flow_patches.launch; give the unpatched "
                        "script (the one you run today)")
    words = split_words(launch.text)
    at = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
    if at is None:
        raise TwinError(f"{name}: its torchrun line runs no .py entry script")
    entry = words[at]
    if not is_flow_entry(entry):
        why = next((why for tail, why in REFUSED_SCRIPTS.items() if entry.endswith(tail)), "not a training entry the "
                   "flow job knows")
        raise TwinError(f"{name}: entry {entry}: {why}; a flow job runs one of MindSpeed-MM's "
                        f"{', '.join(FLOW_ENTRY_SCRIPTS)}")
    script = _Script(name, text.split("\n"), stmts, launch, entry)
    first_arg = _evaluate(script, {}, {}).word(words[at + 1]) if at + 1 < len(words) else ""
    script.config_file = first_arg.endswith((".yaml", ".yml"))
    return script


def _evaluate(script: _Script, edits: dict[str, str], env: dict[str, str]) -> Expander:
    ex = Expander(env)
    for _, name, raw in script.assignments(script.launch.start):
        ex.assign(name, edits.get(name, raw))
    return ex


def _env_form(name: str, raw: str) -> bool:
    m = ENV_DEFAULT.match(raw.strip('"'))
    return bool(m) and m.group("name") == name and raw.strip('"').endswith("}")


def _with_env(name: str, raw: str, value: int | None = None) -> str:
    """`${NAME:-default}`: the environment first; `value` replaces a literal (or literal default)."""
    m = re.fullmatch(rf'"?\$\{{{name}:-(.*)\}}"?', raw, re.S)
    if m:
        literal = m.group(1).isdigit() and value is not None and m.group(1) != str(value)
        return f"${{{name}:-{value}}}" if literal else raw
    if _env_form(name, raw):
        return raw
    if value is not None and re.fullmatch(r'"?\d*"?', raw):
        return f"${{{name}:-{value}}}"
    return f"${{{name}:-{raw}}}"


def make_twin(text: str, name: str, plan: RecipeLaunch) -> Twin:
    script = _parse(text, name)
    launch_var: dict[str, str] = {}
    for role, flags in LAUNCH_FLAGS.items():
        found = script.flag_value(*flags)
        if found is None:
            raise TwinError(f"{name}: its torchrun arguments have no {flags[0]}; a flow launch sets it from a "
                            "variable (as DISTRIBUTED_ARGS does in MindSpeed-MM's examples)")
        var = _var_of(found[1])
        if var is None:
            raise TwinError(f"{name}: {flags[0]} {found[1]} is written literally; give it a variable "
                            f"(e.g. {role.upper()}=...) so each node can set it")
        launch_var[role] = var
    original = _evaluate(script, {}, {})
    nproc_var = launch_var["nproc"]
    user_per_node = original.vars.get(nproc_var)
    per_node = plan.per_node or (int(user_per_node) if known(user_per_node) and user_per_node.isdigit() else None)
    world = plan.world
    if per_node is None:
        raise TwinError(f"{name}: {nproc_var} is not a number the script sets; pass --npus-per-node")
    if world <= per_node:
        nnodes, per_node = 1, world
    elif world % per_node:
        raise TwinError(f"{plan.recipe.name}: the recipe's {world} ranks ({plan.describe()}) do not fill nodes of "
                        f"{per_node} ({nproc_var}={per_node}); plan for a multiple of {per_node} ranks, or pass "
                        "--npus-per-node")
    else:
        nnodes = world // per_node
    edits: dict[str, str] = {}
    for role, var in launch_var.items():
        found = script.last_assignment(var)
        if found is None:
            continue  # read from the environment already
        raw = found[1]
        value = {"nproc": per_node, "nnodes": nnodes}.get(role)
        new = _with_env(var, raw, value)
        if new != raw:
            edits[var] = new
    world_var = script.last_assignment("WORLD_SIZE")
    if world_var and re.fullmatch(r"\"?\d+\"?", world_var[1]) and int(world_var[1].strip('"')) != world:
        edits["WORLD_SIZE"] = str(world)
    token_edits: dict[int, list[tuple[str, str]]] = {}  # physical line -> (old token, new token)
    changed: dict[str, tuple[str, str]] = {}

    def set_size(flags: tuple[str, ...], value: int, default: str) -> None:
        found = script.flag_value(*flags)
        if found is None:
            return
        line, raw = found
        var = _var_of(raw)
        if var is None:
            old = raw
            if old != str(value):
                token_edits.setdefault(line, []).append((f"{flags[0]} {old}", f"{flags[0]} {value}"))
                changed[flags[0]] = (old, str(value))
            return
        current = _evaluate(script, edits, {}).vars.get(var, default)
        if current != str(value):
            assigned = script.last_assignment(var)
            edits[var] = _with_env(var, assigned[1], value) if assigned and _env_form(var, assigned[1]) else \
                str(value)

    if not script.config_file:  # a CONFIG.yaml entry's sizes are in that file (the launcher checks them)
        _, tp, pp, cp = plan.backbone()
        set_size(("--tensor-model-parallel-size",), tp, "1")
        set_size(("--pipeline-model-parallel-size",), pp, "1")
        set_size(("--context-parallel-size",), cp, "1")
        _keep_global_batch(script, plan, edits, token_edits, changed, launch_var, per_node, nnodes)
    return _render(script, plan, edits, token_edits, changed, launch_var, per_node, nnodes)


def _keep_global_batch(script: _Script, plan: RecipeLaunch, edits: dict[str, str],
                       token_edits: dict[int, list[tuple[str, str]]], changed: dict[str, tuple[str, str]],
                       launch_var: dict[str, str], per_node: int, nnodes: int) -> None:
    found = script.flag_value("--global-batch-size")
    if found is None:
        raise TwinError(f"{script.name}: no --global-batch-size: a flow job plans each global batch")
    line, raw = found
    var = _var_of(raw)
    env = {launch_var["nproc"]: str(per_node), launch_var["nnodes"]: str(nnodes), launch_var["node_rank"]: "0"}

    def gbs(with_edits: dict[str, str], environment: dict[str, str]) -> str:
        ex = _evaluate(script, with_edits, environment)
        return ex.vars.get(var, "") if var else ex.word(raw)  # a variable, or arithmetic in the flag string

    before = gbs({}, {})
    target = plan.global_batch if plan.global_batch is not None else (int(before) if before.isdigit() else None)
    now = gbs(edits, env)
    if target is None:
        if not now.isdigit():
            raise TwinError(f"{script.name}: --global-batch-size {raw} is not a number the script computes; state "
                            "trainer.global_batch_size in the recipe")
        target = int(now)
    mbs_found = script.flag_value("--micro-batch-size")
    mbs_raw = mbs_found[1] if mbs_found else "1"
    mbs_var = _var_of(mbs_raw)
    mbs = _evaluate(script, edits, env).vars.get(mbs_var, "1") if mbs_var else mbs_raw
    for pname, dp, *_ in plan.parts:
        if mbs.isdigit() and target % (int(mbs) * dp):
            field_name = "trainer.global_batch_size" if plan.global_batch is not None else "--global-batch-size"
            raise TwinError(f"{plan.recipe.name}: parallel.{pname}.dp={dp}: {field_name} {target} must be divisible "
                            f"by --micro-batch-size {mbs} x dp (every DP rank of every part gets the same share)")
    if now == str(target):
        return
    if var is None:
        token_edits.setdefault(line, []).append((f"--global-batch-size {raw}", f"--global-batch-size {target}"))
        changed["--global-batch-size"] = (raw, str(target))
        return
    assigned = script.last_assignment(var)
    refs = re.findall(NAME, assigned[1]) if assigned else []
    for acc in (r for r in refs if "ACC" in r.upper()):
        acc_assigned = script.last_assignment(acc)
        old = _evaluate(script, edits, env).vars.get(acc, "")
        if not (acc_assigned and old.isdigit() and now.isdigit() and int(now)):
            continue
        new_acc, rest = divmod(target * int(old), int(now))
        if rest == 0 and new_acc > 0:
            trial = dict(edits)
            trial[acc] = _with_env(acc, acc_assigned[1], new_acc) if _env_form(acc, acc_assigned[1]) else str(new_acc)
            if gbs(trial, env) == str(target):
                edits[acc] = trial[acc]
                return
    edits[var] = str(target)


def _replace_value(stmt: Statement, lines: list[str], name: str, new: str) -> list[str]:
    """The statement's lines as one line with the value replaced (a trailing comment kept)."""
    first = lines[stmt.start]
    m = re.match(rf"^(\s*(?:export\s+)?{name}=)", first)
    assert m is not None
    comment = first[len(strip_comment(first)):] if stmt.end - stmt.start == 1 else ""
    return [m.group(1) + new + comment]


def _env_read(text: str, assigned: set[str]) -> dict[str, str]:
    """Variables the script reads from the environment, with their default when it shows one."""
    code = "\n".join(_code(line) for line in text.split("\n"))
    code = re.sub(r"'[^']*'", "''", code)
    out: dict[str, str] = {}
    for m in re.finditer(rf"\$\{{({NAME})(:?[-=?])([^}}]*)\}}", code):
        out.setdefault(m.group(1), m.group(3) if m.group(2).endswith(("-", "=")) else "?")
    for m in re.finditer(rf"\$\{{?({NAME})\}}?", code):
        n = m.group(1)
        if n not in assigned and n not in _SHELL_OWN and n not in out:
            out[n] = ""
    return out


def _render(script: _Script, plan: RecipeLaunch, edits: dict[str, str], token_edits: dict[int, list[tuple[str, str]]],
            changed: dict[str, tuple[str, str]], launch_var: dict[str, str], per_node: int, nnodes: int) -> Twin:
    lines = list(script.lines)
    replaced: dict[int, list[str]] = {}
    for stmt, name, raw in script.assignments(script.launch.start):
        if name in edits and script.last_assignment(name)[0] is stmt:
            replaced[stmt.start] = _replace_value(stmt, lines, name, edits[name])
            for idx in range(stmt.start + 1, stmt.end):
                replaced[idx] = []
            changed[name] = (raw, edits[name])
    for idx, pairs in token_edits.items():
        line = replaced.get(idx, [lines[idx]])[0] if replaced.get(idx, [lines[idx]]) else lines[idx]
        for old, new in pairs:
            line = re.sub(re.escape(old).replace(r"\ ", r"[ \t=]+"), new, line, count=1)
        replaced[idx] = [line]
    rank_var = launch_var["node_rank"]
    log_lines, tee_line = _per_node_log(script, lines, replaced, changed, rank_var)
    recipe_stated = script.last_assignment("FLOW_RECIPE")
    recipe_default = shlex.quote(str(plan.recipe))
    if recipe_stated:
        stmt, raw = recipe_stated
        replaced[stmt.start] = [f"FLOW_RECIPE=${{FLOW_RECIPE:-{recipe_default}}}"]
        for idx in range(stmt.start + 1, stmt.end):
            replaced[idx] = []
        changed["FLOW_RECIPE"] = (raw, f"${{FLOW_RECIPE:-{recipe_default}}}")
    # the entry: its word on its physical line
    launch_lines = list(range(script.launch.start, script.launch.end))
    for idx in launch_lines:
        current = replaced.get(idx, [lines[idx]])
        m = re.search(rf"(^|\s)({re.escape(script.entry)})(\s|$)", current[0]) if current else None
        if m:
            replaced[idx] = [current[0][:m.start(2)] + ENTRY + " " + current[0][m.start(2):]]
            break
    if tee_line is not None:
        idx = launch_lines[-1]
        replaced[idx] = [replaced.get(idx, [lines[idx]])[0] + tee_line]
    block = _check_block(script, plan, launch_var, nnodes * per_node, None if recipe_stated else recipe_default,
                         log_lines)
    out: list[str] = []
    for idx, line in enumerate(lines):
        if idx == script.launch.start:
            out += block
        out += replaced.get(idx, [line])
        if idx == script.launch.end - 1:
            out.append("FLOW_STATUS=${PIPESTATUS[0]}  # mindspeed-flow: the script exits with torchrun's status")
    while out and out[-1] == "":
        out.pop()
    out += ['exit "$FLOW_STATUS"', ""]
    body = "\n".join(out)
    assigned = set(re.findall(rf"(?:^|[\s;])(?:export\s+|local\s+)?({NAME})=", body))
    env_vars = _describe_env(_env_read(body, assigned - set(launch_var.values())), launch_var, per_node, nnodes,
                             plan, bool(log_lines))
    header = _header(script.name, plan, env_vars, nnodes, per_node, launch_var)
    # after the shebang and the comments that open the script (shellcheck directives there cover the whole file)
    at = 0
    while at < len(out) and out[at].startswith("#") and not out[at].startswith(BLOCK_START):
        at += 1
    out = out[:at] + header + out[at:]
    return Twin("\n".join(out), nnodes, per_node, changed, env_vars, dict(launch_var))


def _per_node_log(script: _Script, lines: list[str], replaced: dict[int, list[str]],
                  changed: dict[str, tuple[str, str]], rank_var: str) -> tuple[list[str], str | None]:
    """Make the script's tee per node; or, without one, (lines that set FLOW_LOG, the tee to append)."""
    text = "\n".join(lines[script.launch.start:script.launch.end])
    m = re.search(r"\|\s*tee\s+(?:-a\s+)?(\S+)", text)
    suffix = f"_node${{{rank_var}}}"
    if not m:
        return ([f'FLOW_LOG=${{FLOW_LOG_DIR:-logs}}/train_$(date +%Y%m%d_%H%M%S){suffix}.log',
                 'mkdir -p "$(dirname "$FLOW_LOG")"'], ' 2>&1 | tee "$FLOW_LOG"')
    target = m.group(1)
    names = re.findall(rf"\$\{{?({NAME})\}}?", target)
    for n in names:
        found = script.last_assignment(n)
        if found:
            stmt, raw = found
            new = raw[:-1] + suffix + '"' if raw.endswith('"') else raw + suffix
            replaced[stmt.start] = _replace_value(stmt, lines, n, new)
            changed[n] = (raw, new)
            return [], None
    new_target = target[:-4] + suffix + ".log" if target.endswith(".log") else target + suffix
    for idx in range(script.launch.start, script.launch.end):
        if target in lines[idx]:
            replaced[idx] = [replaced.get(idx, [lines[idx]])[0].replace(target, new_target, 1)]
            changed["tee"] = (target, new_target)
    return [], None


def _check_block(script: _Script, plan: RecipeLaunch, launch_var: dict[str, str], world: int,
                 recipe_default: str | None, log_lines: list[str]) -> list[str]:
    nproc, nnodes = launch_var["nproc"], launch_var["nnodes"]
    out = [BLOCK_START + " (written by `mindspeed-flow launch-script --from`)"]
    if recipe_default:
        out.append(f"FLOW_RECIPE=${{FLOW_RECIPE:-{recipe_default}}}")
    out += [
        'flow_fail() { echo "$(basename "$0"): error: $*" >&2; exit 2; }',
        f'[ "$(({nnodes} * {nproc}))" -eq {world} ] || flow_fail "{nnodes}=${nnodes} x {nproc}=${nproc} = '
        f'$(({nnodes} * {nproc})) ranks, but the parts of $FLOW_RECIPE need {world} ({plan.describe()})"',
        'if [ ! -f "$FLOW_RECIPE" ] || [ ! -r "$FLOW_RECIPE" ]; then flow_fail "FLOW_RECIPE=$FLOW_RECIPE is not '
        'readable on this node ($HOSTNAME): put the recipe on storage every node shares"; fi',
    ]
    dirs = [(flag, found[1].strip('"'), mode) for flag, mode in (("--load", "read"), ("--save", "write"),
                                                                  ("--tensorboard-dir", "write"))
            if (found := script.flag_value(flag))]
    if plan.run_dir:
        dirs.append(("run_dir", plan.run_dir, "write"))
    if dirs:
        out += [
            "flow_need_dir() {  # FLAG PATH read|write: readable (read), or creatable and writable (write), here",
            '  local dir=$2',
            '  [ -n "$dir" ] || return 0',
            '  if [ "$3" = read ]; then [ -d "$dir" ] && [ -r "$dir" ] && return 0',
            '  else while [ ! -e "$dir" ]; do dir=$(dirname "$dir"); done; [ -d "$dir" ] && [ -w "$dir" ] && return 0; '
            'fi',
            '  local what=writable; [ "$3" = write ] || what=readable',
            '  flow_fail "$1 $2 is not $what on this node ($HOSTNAME): the run folders must be on storage every node '
            'shares"',
            "}",
        ] + [f'flow_need_dir {flag} "{path}" {mode}' for flag, path, mode in dirs]
    out += ['if [ -n "${FLOW_SOCKET_IFNAME:-}" ]; then',
            '  export GLOO_SOCKET_IFNAME=$FLOW_SOCKET_IFNAME HCCL_SOCKET_IFNAME=$FLOW_SOCKET_IFNAME', "fi"]
    return out + log_lines + [BLOCK_END]


def _describe_env(read: dict[str, str], launch_var: dict[str, str], per_node: int, nnodes: int,
                  plan: RecipeLaunch, own_log: bool) -> dict[str, str]:
    role = {v: k for k, v in launch_var.items()}
    what = {
        "nproc": f"ranks on this node (the plan: {per_node})",
        "nnodes": f"nodes (the plan: {nnodes})",
        "node_rank": f"this node's rank, 0 to {nnodes - 1}",
        "master_addr": "the address of node 0 (the rendezvous)",
        "master_port": "the rendezvous port on node 0",
    }
    out: dict[str, str] = {}
    for n, default in read.items():
        if n in role:
            text = what[role[n]]
        elif n == "FLOW_RECIPE":
            text = "the flow recipe; must be readable on every node (default: the path it was planned at)"
        elif n == "FLOW_SOCKET_IFNAME":
            text = "the network interface for gloo and HCCL (sets GLOO_SOCKET_IFNAME and HCCL_SOCKET_IFNAME)"
        elif n == "FLOW_LOG_DIR" and own_log:
            text = "where each node writes train_<date>_node<rank>.log (default: logs)"
        else:
            text = "read by the original script" + (" (required)" if default == "?" else
                                                     f" (default: {default})" if default else "")
        out[n] = text
    return out


def _header(name: str, plan: RecipeLaunch, env_vars: dict[str, str], nnodes: int, per_node: int,
            launch_var: dict[str, str]) -> list[str]:
    width = max(len(n) for n in env_vars) if env_vars else 0
    desc = ", ".join(f"{n} dp{dp} tp{tp} pp{pp} cp{cp}" for n, dp, tp, pp, cp in plan.parts)
    lines = [
        f"# The flow twin of {name}: the same job trained decoupled with {plan.recipe.name} ({plan.world} ranks = "
        f"{desc}), {nnodes} node(s) x {per_node}.",
        f"# On every node: {launch_var['node_rank']}=<i> {launch_var['master_addr']}=<node-0 address> bash THIS "
        "(from the folder the original runs in).",
        "# The recipe and the save / load / run folders must be on storage every node shares. Each node logs to "
        "logs/train_<date>_node<rank>.log.",
        "# Environment it reads:",
    ] + [f"#   {n.ljust(width)}  {text}" for n, text in env_vars.items()]
    return lines + [HEADER_END,
                    'case "${1:-}" in -h | --help) awk -v end="' + HEADER_END + '" \'/^# The flow twin/ { on = 1 } '
                    '$0 == end { exit } on { sub(/^# ?/, ""); print }\' "$0"; exit 0 ;; esac']



def entry_of(text: str, name: str) -> str:
    """The entry script the user's launch script runs (TwinError when it is none a flow job runs)."""
    return _parse(text, name).entry


def job_command(text: str, name: str, env: dict[str, str] | None = None) -> tuple[str, list[str]]:
    """(entry script, its arguments) as the torchrun line of `text` would run them on node 0, read without running
    anything (variables from `env` and the script's assignments; bash's word splitting of unquoted expansions; the
    pipe and redirections dropped). A value only a command gives holds `shell_words.UNKNOWN`."""
    script = _parse(text, name, twin=True)
    ex = _evaluate(script, {}, dict(env or {}))
    words: list[str] = []
    for raw in split_words(script.launch.text):
        if raw in ("|", "||", "&&", ";", "&") or raw.startswith("|"):
            break
        if re.fullmatch(r"\d*>>?&?\S*|<\S*", raw):
            continue  # a redirection
        value = ex.word(raw)
        words += [value] if raw.startswith(("'", '"')) else value.split()
    at = next(i for i, w in enumerate(words) if w.endswith(".py"))
    return words[at], words[at + 1:]
