"""Both launchers answer every view of a job that `staleflow up` reads while it runs and when it
writes the summary (a view missing on one launcher ends that launcher's monitoring loop)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from staleflow.launch.local import LocalJob
from staleflow.launch.ray.job import RayClusterJob

ROOT = Path(__file__).resolve().parents[3]


def _job_attributes_read(*files: Path) -> set[str]:
    names = set()
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value  # job.x, or self.job.x
            if (isinstance(owner, ast.Name) and owner.id == "job") or (isinstance(owner, ast.Attribute)
                                                                        and owner.attr == "job"):
                names.add(node.attr)
    return names


def test_the_ray_launcher_offers_every_job_view_up_reads() -> None:
    read = _job_attributes_read(ROOT / "cli" / "up.py", ROOT / "launch" / "views.py")
    offered_by_job = {name for name in read if hasattr(LocalJob, name)}
    assert {"steps", "failover", "length_skew", "coordinator_stats"} <= offered_by_job
    missing = sorted(name for name in offered_by_job
                     if callable(inspect.getattr_static(LocalJob, name, None)) and not hasattr(RayClusterJob, name))
    assert not missing, f"RayClusterJob lacks {missing}"


def test_no_launcher_borrows_another_class_s_method() -> None:
    """A launcher's method never runs another class's method with itself as ``self``
    (``Other.method(self, ...)``): what two launchers share is a base class of both."""
    borrowed = []
    for file in sorted((ROOT / "launch").rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id[:1].isupper() \
                    and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "self":
                borrowed.append(f"{file.relative_to(ROOT)}:{node.lineno} {node.func.value.id}.{node.func.attr}(self)")
    assert not borrowed, borrowed
