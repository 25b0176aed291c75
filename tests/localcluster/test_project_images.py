"""The controller and agent images built here (localcluster/project_images.py): each archive unpacked and
its entrypoint run by runc in a read-only root without network, as a kubelet's runtime would start it;
what the images hold (production code only, the Dockerfiles' entrypoint, config and user); the tags and the
cache."""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dynamo_snapshot.cli.main import build_parser
from dynamo_snapshot.criu import MIN_VERSION, CriuVersion
from dynamo_snapshot_dev.localcluster.images import ANNOTATION_CONTAINERD_NAME, ImageBuildError, project_root
from dynamo_snapshot_dev.localcluster.project_images import (
    AGENT_REPOSITORY,
    CONTROLLER_REPOSITORY,
    CONTROLLER_UID,
    LOCAL_TAG,
    agent_image,
    agent_image_archive,
    controller_image,
    controller_image_archive,
)

CONFIGS = ("controller/config.yaml", "agent/config.yaml")


@dataclass(frozen=True)
class Unpacked:
    """An image archive's index, its image config and its one layer's root filesystem."""

    names: list[str]
    manifests: set[str]
    config: dict[str, Any]
    rootfs: Path


def _copy_sources(dst: Path) -> Path:
    src = project_root()
    shutil.copytree(
        src / "dynamo_snapshot", dst / "dynamo_snapshot", ignore=shutil.ignore_patterns("__pycache__")
    )
    for config in CONFIGS:
        (dst / config).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / config, dst / config)
    return dst


@pytest.fixture(scope="module")
def frozen_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the sources the images take: others may edit the checkout meanwhile."""
    return _copy_sources(tmp_path_factory.mktemp("repo"))


def _unpack(archive: Path, dest: Path) -> Unpacked:
    with tarfile.open(archive) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]

    def blob(digest: str) -> bytes:
        return members[f"blobs/sha256/{digest.removeprefix('sha256:')}"]

    index = json.loads(members["index.json"])
    descriptors = index["manifests"]
    manifest = json.loads(blob(descriptors[0]["digest"]))
    (layer,) = manifest["layers"]
    rootfs = dest / "rootfs"
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob(layer["digest"])))) as tar:
        tar.extractall(rootfs, filter="fully_trusted")
    return Unpacked(
        names=[d["annotations"][ANNOTATION_CONTAINERD_NAME] for d in descriptors],
        manifests={d["digest"] for d in descriptors},
        config=json.loads(blob(manifest["config"]["digest"]))["config"],
        rootfs=rootfs,
    )


@pytest.fixture(scope="module")
def controller(frozen_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Unpacked:
    _, archive = controller_image_archive(frozen_repo, cache=tmp_path_factory.mktemp("cache"))
    return _unpack(archive, tmp_path_factory.mktemp("controller"))


@pytest.fixture(scope="module")
def agent(frozen_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Unpacked:
    _, archive = agent_image_archive(frozen_repo, cache=tmp_path_factory.mktemp("cache"))
    return _unpack(archive, tmp_path_factory.mktemp("agent"))


def _runc() -> str:
    if os.geteuid() != 0:
        pytest.skip("runc needs root: re-run with sudo")
    runc = shutil.which("runc")
    assert runc is not None, "runc is missing: apt-get install runc"
    return runc


def _run(image: Unpacked, args: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    """`args` run by runc in `image`'s root (read-only, a tmpfs /tmp, a network namespace of its own),
    with the image's env and user, as a kubelet's runtime starts a container."""
    runc = _runc()
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=tmp))
    bundle = run_dir / "bundle"
    bundle.mkdir()
    subprocess.run([runc, "spec", "--bundle", str(bundle)], check=True)
    spec = json.loads((bundle / "config.json").read_text())
    uid = int(image.config.get("User") or 0)
    spec["process"].update(
        terminal=False,
        args=args,
        env=image.config["Env"],
        cwd=image.config["WorkingDir"],
        user={"uid": uid, "gid": uid},
    )
    spec["root"] = {"path": str(image.rootfs), "readonly": True}
    spec["mounts"].append(
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev"]}
    )
    assert {"type": "network"} in spec["linux"]["namespaces"]
    (bundle / "config.json").write_text(json.dumps(spec))
    return subprocess.run(
        [runc, "--root", str(run_dir / "state"), "run", "--bundle", str(bundle), run_dir.name],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _dockerfile_entrypoint(name: str) -> list[str]:
    text = (project_root() / name / "Dockerfile").read_text()
    match = re.search(r"^ENTRYPOINT (\[.*\])$", text, re.MULTILINE)
    assert match, f"{name}/Dockerfile has no ENTRYPOINT"
    entrypoint: list[str] = json.loads(match.group(1))
    return entrypoint


def _flags(command: str) -> set[str]:
    """Every option string of `dynamo-snapshot <command>`, from the parser the image runs."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return {flag for action in sub.choices[command]._actions for flag in action.option_strings}  # type: ignore[attr-defined]


def test_controller_image_is_the_dockerfiles(controller: Unpacked, frozen_repo: Path) -> None:
    assert controller.config["Entrypoint"] == _dockerfile_entrypoint("controller")
    assert controller.config["User"] == str(CONTROLLER_UID)
    config_path = controller.config["Entrypoint"][-1]
    assert (controller.rootfs / config_path.lstrip("/")).read_bytes() == (
        frozen_repo / "controller/config.yaml"
    ).read_bytes()
    assert (
        f"controller:x:{CONTROLLER_UID}:{CONTROLLER_UID}:" in (controller.rootfs / "etc/passwd").read_text()
    )
    image = controller_image(frozen_repo)
    assert controller.names == [image.name, f"{CONTROLLER_REPOSITORY}:{LOCAL_TAG}"]
    assert len(controller.manifests) == 1, "both names are one image"


def test_agent_image_is_the_dockerfiles(agent: Unpacked, frozen_repo: Path) -> None:
    assert agent.config["Entrypoint"] == _dockerfile_entrypoint("agent")
    assert agent.config.get("User", "") == ""
    config_path = agent.config["Entrypoint"][-1]
    assert (agent.rootfs / config_path.lstrip("/")).read_bytes() == (
        frozen_repo / "agent/config.yaml"
    ).read_bytes()
    assert agent.names == [agent_image(frozen_repo).name, f"{AGENT_REPOSITORY}:{LOCAL_TAG}"]


@pytest.mark.parametrize("which", ["controller", "agent"])
def test_images_hold_production_code_only(which: str, request: pytest.FixtureRequest) -> None:
    image: Unpacked = request.getfixturevalue(which)
    site = image.rootfs / "usr/lib/python3/dist-packages"
    package = site / "dynamo_snapshot"
    # The product and the worker SDK it depends on; the dev harness (a package of its own) is not there.
    assert (package / "cli/main.py").is_file()
    assert (package / "workload/__init__.py").is_file()
    assert not (site / "dynamo_snapshot_dev").exists()
    assert not (image.rootfs / "usr/lib/python3.11/test").exists()
    # Bytecode compiled at build time, hash-based and unchecked (flags 0b01): no compile at each start.
    pyc = package / "cli/__pycache__/main.cpython-311.pyc"
    assert int.from_bytes(pyc.read_bytes()[4:8], "little") == 0b01
    sizes = sum(f.stat().st_size for f in image.rootfs.rglob("*") if f.is_file() and not f.is_symlink())
    assert sizes < 250 << 20, f"the {which} image's tree is {sizes >> 20} MiB"


def _sh(image: Unpacked, script: str, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``sh -c script sh args...`` run by runc in the image, as the agent runs its shell helpers."""
    return _run(image, ["sh", "-c", script, "sh", *args], tmp)


@pytest.mark.parametrize("which", ["controller", "agent"])
def test_image_entrypoint_starts_under_runc(
    which: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    image: Unpacked = request.getfixturevalue(which)
    proc = _run(image, [*image.config["Entrypoint"], "--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    flags = _flags(which)
    assert {"--config", "--log-level"} <= flags, flags
    missing = {flag for flag in flags if flag not in proc.stdout}
    assert not missing, (
        f"`dynamo-snapshot {which} --help` in the image does not name {missing}:\n{proc.stdout}"
    )


def test_controller_image_runs_as_its_user_and_leaves_the_demo_out(
    controller: Unpacked, tmp_path: Path
) -> None:
    proc = _run(controller, ["dynamo-snapshot", "demo"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "invalid choice: 'demo'" in proc.stderr
    demo = _run(controller, ["python3", "-c", "import dynamo_snapshot_dev"], tmp_path)
    assert "No module named 'dynamo_snapshot_dev'" in demo.stderr, demo.stderr
    who = _run(controller, ["python3", "-c", "import os; print(os.getuid())"], tmp_path)
    assert who.stdout.strip() == str(CONTROLLER_UID), who.stderr


def test_agent_image_carries_the_programs_the_agent_execs(agent: Unpacked, tmp_path: Path) -> None:
    # nsenter and unshare by name through /bin/sh's `exec "$@"`, as the agent's cgroup-joining script
    # starts them: util-linux's must run, not a shell's built-in applet of that name.
    script = (
        "criu --version && runc --version && mkdir -p /tmp/p && cp /etc/passwd /tmp/p/.x"
        ' && mv -f /tmp/p/.x /tmp/p/x && cat /tmp/p/x && exec "$@"'
    )
    proc = _sh(agent, script, tmp_path, "nsenter", "--version")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    unshare = _sh(agent, 'exec "$@"', tmp_path, "unshare", "--version")
    assert unshare.returncode == 0, unshare.stdout + unshare.stderr
    assert "unshare from util-linux" in unshare.stdout
    # CRIU's tmpfs dump and restore, as it runs them: GNU tar's options, gzip through --gzip.
    tmpfs = _sh(
        agent,
        "mkdir -p /tmp/t && echo kept > /tmp/t/f && tar --create --gzip --sparse --numeric-owner"
        " --one-file-system --check-links --directory /tmp/t . | tar --extract --gzip --to-stdout",
        tmp_path,
    )
    assert tmpfs.returncode == 0, tmpfs.stdout + tmpfs.stderr
    assert tmpfs.stdout == "kept\n"
    version = CriuVersion.parse(proc.stdout)
    assert version.at_least(MIN_VERSION), str(version)
    assert "runc version" in proc.stdout
    assert (agent.rootfs / "etc/passwd").read_text() in proc.stdout
    assert proc.stdout.rstrip().endswith("nsenter from util-linux " + proc.stdout.rstrip().rsplit(" ", 1)[-1])


def test_the_entry_script_starts_nothing_in_a_spawned_helper(agent: Unpacked, tmp_path: Path) -> None:
    # The artifact checks' helper processes are spawned, which runs the main module again in each child
    # as __mp_main__: the script must start the agent only as __main__.
    proc = _run(
        agent,
        ["python3", "-c", "import runpy; runpy.run_path('/usr/bin/dynamo-snapshot', run_name='__mp_main__');"
         " print('no agent started')"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == "no agent started\n"


def test_tags_follow_their_inputs_and_archives_are_cached(tmp_path: Path) -> None:
    repo = _copy_sources(tmp_path / "repo")
    controller_first, agent_first = controller_image(repo), agent_image(repo)
    assert controller_image(repo) == controller_first
    (repo / "agent/config.yaml").write_text((repo / "agent/config.yaml").read_text() + "# a change\n")
    assert agent_image(repo).tag != agent_first.tag
    assert controller_image(repo) == controller_first, "the agent's config is not the controller's input"
    main = repo / "dynamo_snapshot/cli/main.py"
    main.write_text(main.read_text() + "\n# a change\n")
    assert controller_image(repo).tag != controller_first.tag

    cache = tmp_path / "cache"
    stale = cache / "images" / "controller-000000000000.tar"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"an archive of sources that are gone")
    image, archive = controller_image_archive(repo, cache=cache)
    assert archive == cache / "images" / f"controller-{image.tag}.tar"
    assert not stale.exists()
    before = archive.stat()
    assert controller_image_archive(repo, cache=cache) == (image, archive)
    after = archive.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), (
        "the cached one was rebuilt"
    )


def test_images_outside_a_checkout_are_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ImageBuildError, match="is not a dynamo-snapshot source checkout"):
        controller_image(tmp_path)
    (tmp_path / "dynamo_snapshot/cli").mkdir(parents=True)
    (tmp_path / "dynamo_snapshot/cli/main.py").write_text("")
    with pytest.raises(ImageBuildError, match=re.escape(f"{tmp_path}/agent/config.yaml is missing")):
        agent_image(tmp_path)
