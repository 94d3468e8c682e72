"""deploy/kubernetes read as a cluster reads it: kustomizations rendered, a container's environment
and command line resolved as the kubelet resolves them, its volumes mapped onto local directories.

Rendering covers what our kustomizations use and nothing more: `resources` (files, and directories
holding a kustomization.yaml) and `patches` with a `target` (kind, name) and an inline JSON 6902
patch, applied by the `jsonpatch` library (RFC 6902, the format kustomize applies). Any other
kustomization field raises, so a kustomization that grows one fails here instead of rendering wrong.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonpatch
import yaml

KUBERNETES_DIR = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
VARIANTS = {"cpu": KUBERNETES_DIR, "gpu": KUBERNETES_DIR / "gpu", "tenants": KUBERNETES_DIR / "tenants"}
Resource = dict[str, Any]
_KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "patches"}


def load_documents(path: Path) -> list[Resource]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def render(directory: Path) -> list[Resource]:
    """What `kubectl kustomize DIRECTORY` prints, as objects."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - _KUSTOMIZATION_FIELDS
    if unknown:
        raise ValueError(
            f"{directory}: this renderer knows only {sorted(_KUSTOMIZATION_FIELDS)}, not {sorted(unknown)}"
        )
    resources: list[Resource] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        resources += render(path) if path.is_dir() else load_documents(path)
    for patch in kustomization.get("patches", []):
        if set(patch) != {"target", "patch"} or set(patch["target"]) != {"kind", "name"}:
            raise ValueError(f"{directory}: only inline patches with a kind/name target are rendered, got {patch}")
        target = find(resources, patch["target"]["kind"], patch["target"]["name"])
        patched = jsonpatch.apply_patch(target, yaml.safe_load(patch["patch"]))
        resources[resources.index(target)] = patched
    return resources


def find(resources: list[Resource], kind: str, name: str) -> Resource:
    matches = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def container(pod_spec: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The container or init container `name` of a pod spec."""
    matches = [c for c in pod_spec.get("initContainers", []) + pod_spec["containers"] if c["name"] == name]
    assert len(matches) == 1, f"expected one container {name}, found {len(matches)}"
    return matches[0]


@dataclass(frozen=True)
class Pod:
    """What the kubelet knows of a pod when it starts its containers (the downward API's fields)."""

    name: str
    ip: str = "127.0.0.1"
    namespace: str = "servelm"

    def field(self, path: str) -> str:
        return {"metadata.name": self.name, "metadata.namespace": self.namespace, "status.podIP": self.ip}[path]


# $(NAME) is replaced when NAME is defined, `$$` is a literal `$`, anything else stays as written
# (so a shell's `$((i + 1))` or `${X}` reaches the shell untouched), as in Kubernetes.
_REFERENCE = re.compile(r"\$\$|\$\(([^)]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        return "$" if match.group() == "$$" else env.get(match.group(1), match.group())

    return _REFERENCE.sub(replace, text)


def container_env(
    spec: Mapping[str, Any], pod: Pod, resources: list[Resource], secrets: Mapping[str, Mapping[str, str]]
) -> dict[str, str]:
    """The container's environment: envFrom first, then env in order (a later entry may refer to
    an earlier one as $(NAME)). `secrets`: Secret name -> its data (tests make them up)."""
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        if "configMapRef" in source:
            env.update(find(resources, "ConfigMap", source["configMapRef"]["name"])["data"])
        else:
            env.update(secrets[source["secretRef"]["name"]])
    for variable in spec.get("env", []):
        if "value" in variable:
            env[variable["name"]] = expand(variable["value"], env)
            continue
        source = variable["valueFrom"]
        if "fieldRef" in source:
            env[variable["name"]] = pod.field(source["fieldRef"]["fieldPath"])
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[variable["name"]] = find(resources, "ConfigMap", ref["name"])["data"][ref["key"]]
        else:
            ref = source["secretKeyRef"]
            env[variable["name"]] = secrets[ref["name"]][ref["key"]]
    return env


def command_line(spec: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """The argv the container starts with (our containers all name their command: no image entrypoint)."""
    assert spec.get("command"), f"container {spec['name']} relies on the image's entrypoint"
    return [expand(part, env) for part in spec["command"] + spec.get("args", [])]


def shell_exec_argv(argv: list[str], env: Mapping[str, str], program: str, workdir: Path) -> list[str]:
    """Run a container's `sh -c SCRIPT` with its environment and return the arguments the script
    finally calls `program` with: a stand-in on PATH records them and exits."""
    assert argv[:2] == ["sh", "-c"], f"not a shell command: {argv}"
    bindir = workdir / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    record = workdir / "argv.json"
    stand_in = bindir / program
    stand_in.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "with open(os.environ['ARGV_RECORD'], 'w') as f:\n    json.dump(sys.argv[1:], f)\n"
    )
    stand_in.chmod(0o755)
    shell_env = {**env, "PATH": f"{bindir}:/usr/bin:/bin", "ARGV_RECORD": str(record)}
    subprocess.run(["sh", "-c", *argv[2:]], env=shell_env, check=True, timeout=30, capture_output=True)
    return json.loads(record.read_text())


def mounts(spec: Mapping[str, Any], volumes: Mapping[str, Path]) -> dict[str, Path]:
    """mountPath -> the local directory standing for that volume (`volumes`: volume name -> directory)."""
    return {mount["mountPath"]: volumes[mount["name"]] for mount in spec.get("volumeMounts", [])}


def localize(text: str, mounted: Mapping[str, Path]) -> str:
    """A path inside the container as the local path backing it; other text unchanged."""
    for mount_path, local in sorted(mounted.items(), key=lambda item: -len(item[0])):
        if text == mount_path or text.startswith(mount_path.rstrip("/") + "/"):
            return str(local) + text[len(mount_path.rstrip("/")) :]
    return text


def secret_volume_dirs(
    pod_spec: Mapping[str, Any], secrets: Mapping[str, Mapping[str, str]], root: Path
) -> dict[str, Path]:
    """A directory per Secret volume of the pod, holding one file per key as the kubelet projects it."""
    out = {}
    for volume in pod_spec.get("volumes", []):
        if "secret" in volume:
            directory = root / volume["name"]
            directory.mkdir(parents=True, exist_ok=True)
            for key, value in secrets[volume["secret"]["secretName"]].items():
                (directory / key).write_text(value)
            out[volume["name"]] = directory
    return out


def option(argv: list[str], flag: str) -> list[str]:
    """Every value given to `flag` in argv (`--flag VALUE` form)."""
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == flag]


def without_options(argv: list[str], flags: set[str]) -> list[str]:
    """argv less each `--flag VALUE` pair for the flags named."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        else:
            out.append(arg)
    return out


def named_port(spec: Mapping[str, Any], port: int | str) -> int:
    """A probe's port as a number: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    matches = [p["containerPort"] for p in spec.get("ports", []) if p.get("name") == port]
    assert len(matches) == 1, f"container {spec['name']} has no port named {port!r}"
    return matches[0]
