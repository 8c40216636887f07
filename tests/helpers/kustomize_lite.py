"""Render a kustomization the way `kubectl kustomize` does, for the little deploy/ uses.

Used by the deploy tests when kubectl is not on PATH (and checked against
kubectl when it is). It knows only what deploy/kubernetes uses, and refuses the
rest rather than render it wrongly: ``resources`` (files and directories),
``patches`` with a ``path`` (strategic merge: maps merge, lists of objects
merge by ``name`` or ``mountPath``, other lists are replaced) and
``configMapGenerator`` with ``files`` and ``disableNameSuffixHash``.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import yaml

Object = dict[str, Any]
KNOWN_FIELDS = {"apiVersion", "kind", "resources", "patches", "configMapGenerator"}
MERGE_KEYS = ("name", "mountPath")


def load_documents(path: Path) -> list[Object]:
    with open(path) as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc]


def render_lite(directory: Path) -> list[Object]:
    with open(directory / "kustomization.yaml") as handle:
        kustomization = yaml.safe_load(handle)
    unknown = set(kustomization) - KNOWN_FIELDS
    assert not unknown, f"{directory}: the lite renderer does not know {sorted(unknown)}"
    objects: list[Object] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        objects += render_lite(path) if path.is_dir() else load_documents(path)
    for generator in kustomization.get("configMapGenerator", []):
        options = generator.get("options", {})
        assert options.get("disableNameSuffixHash") is True, "a hashed name is not rendered"
        metadata: Object = {"name": generator["name"]}
        if options.get("labels"):
            metadata["labels"] = dict(options["labels"])
        data = {Path(name).name: (directory / name).read_text()
                for name in generator["files"]}
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata,
                        "data": data})
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"path"}, f"only strategic-merge patch files: {patch}"
        for change in load_documents(directory / patch["path"]):
            (target,) = [obj for obj in objects if obj["kind"] == change["kind"]
                         and obj["metadata"]["name"] == change["metadata"]["name"]]
            merged = merge(target, change)
            target.clear()
            target.update(merged)
    return objects


def merge(base: Any, change: Any) -> Any:
    """Strategic merge of ``change`` into ``base`` (a new value; neither is modified)."""
    if isinstance(base, dict) and isinstance(change, dict):
        out = copy.deepcopy(base)
        for key, value in change.items():
            out[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(change, list):
        key = _merge_key(base + change)
        if key is None:
            return copy.deepcopy(change)
        out = copy.deepcopy(base)
        for item in change:
            index = [i for i, old in enumerate(out) if old[key] == item[key]]
            if index:
                out[index[0]] = merge(out[index[0]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(change)


def _merge_key(items: list[Any]) -> str | None:
    for key in MERGE_KEYS:
        if items and all(isinstance(item, dict) and key in item for item in items):
            return key
    return None


def render_kubectl(kubectl: str, directory: Path) -> list[Object]:
    out = subprocess.run([kubectl, "kustomize", str(directory)], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def canonical(value: Any) -> Any:
    """Lists of objects sorted by their merge key: kustomize puts a patch's new
    items first, the lite renderer last, and the order means nothing there."""
    if isinstance(value, dict):
        return {key: canonical(item) for key, item in value.items()}
    if isinstance(value, list):
        items = [canonical(item) for item in value]
        key = _merge_key(items)
        return sorted(items, key=lambda item: item[key]) if key else items
    return value


def by_identity(objects: list[Object]) -> dict[tuple[str, str], Object]:
    """Objects by (kind, name), their lists of objects in canonical order."""
    found = {(obj["kind"], obj["metadata"]["name"]): canonical(obj) for obj in objects}
    assert len(found) == len(objects), "two objects of one kind share a name"
    return found
