"""The release workflow (.github/workflows/release.yml) and the script that pins the chart's
images by digest. No Docker engine or GitHub here: the workflow is checked against GitHub's
workflow schema and for what it must do; the pinning runs on a copy of the chart, which helm
must then lint, package and render with every Sluice image pinned."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from k8s_tools import tool
from kube_chart import CHART_CRDS, install_crds, server_errors

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
CHART = ROOT / "charts" / "sluice"
IMAGES = {"sluice-engine": "engine_image/Dockerfile", "sluice-gateway": "gateway/Dockerfile",
          "sluice-operator": "operator/Dockerfile"}
DIGESTS = {name: f"sha256:{i:064x}" for i, name in enumerate(IMAGES, start=1)}

spec = importlib.util.spec_from_file_location(
    "pin_chart_images", ROOT / ".github" / "scripts" / "pin_chart_images.py")
pin_chart_images = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pin_chart_images)


@pytest.fixture(scope="module")
def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def steps_using(job: dict, action: str) -> list[dict]:
    return [s for s in job["steps"] if s.get("uses", "").startswith(action + "@")]


def test_workflow_matches_githubs_schema():
    pytest.importorskip("check_jsonschema", reason="installed by the Makefile (make lint)")
    out = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                          "vendor.github-workflows", str(WORKFLOW)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_version_tag_runs_e2e_then_images_then_the_chart(workflow):
    on = workflow[True]  # YAML 1.1 reads the key `on` as a boolean
    assert list(on) == ["push"] and on["push"] == {"tags": ["v[0-9]+.[0-9]+.[0-9]+*"]}
    jobs = workflow["jobs"]
    assert workflow["permissions"] == {"contents": "read"}  # write only where it pushes
    assert "needs" not in jobs["e2e"]
    assert jobs["images"]["needs"] == "e2e" and jobs["chart"]["needs"] == "images"
    assert [s["run"] for s in jobs["e2e"]["steps"] if "run" in s] == ["e2e/run.sh"]
    assert steps_using(jobs["e2e"], "helm/kind-action")[0]["with"] == {"install_only": True}
    for name in ("images", "chart"):
        assert jobs[name]["permissions"] == {"contents": "read", "packages": "write"}


def test_the_three_images_are_built_for_amd64_and_arm64_and_pushed_to_ghcr(workflow):
    job = workflow["jobs"]["images"]
    matrix = {m["image"]: m["dockerfile"] for m in job["strategy"]["matrix"]["include"]}
    assert matrix == IMAGES and all((ROOT / f).is_file() for f in matrix.values())
    assert steps_using(job, "docker/setup-qemu-action")
    build = steps_using(job, "docker/build-push-action")[0]["with"]
    assert build["platforms"] == "linux/amd64,linux/arm64" and build["push"] is True
    assert build["context"] == "." and build["file"] == "${{ matrix.dockerfile }}"
    names = next(s for s in job["steps"] if s.get("id") == "names")["run"]
    assert 'ref=ghcr.io/${owner}/${IMAGE}' in names and "${GITHUB_REPOSITORY_OWNER,,}" in names
    assert build["tags"] == "${{ steps.names.outputs.ref }}:${{ steps.names.outputs.version }}"
    login = steps_using(job, "docker/login-action")[0]["with"]
    assert login["registry"] == "ghcr.io"


def test_each_image_builds_from_its_official_base_pinned_by_digest(workflow):
    """The pin step's own shell reads each Dockerfile's base ARG (a tag, to resolve); the
    build gets tag@digest for that ARG and records both as OCI labels."""
    job = workflow["jobs"]["images"]
    step = next(s for s in job["steps"] if s.get("id") == "base")
    build = steps_using(job, "docker/build-push-action")[0]["with"]
    assert build["build-args"].strip() == ("${{ matrix.base_arg }}=${{ steps.base.outputs.name "
                                           "}}@${{ steps.base.outputs.digest }}")
    assert "org.opencontainers.image.base.digest=${{ steps.base.outputs.digest }}" in \
        build["labels"]
    assert "imagetools inspect" in step["run"] and "sha256:*" in step["run"]
    read_tag = step["run"].splitlines()[0]  # ref="$(sed ... "$DOCKERFILE")"
    for entry in job["strategy"]["matrix"]["include"]:
        env = {"DOCKERFILE": entry["dockerfile"], "BASE_ARG": entry["base_arg"]}
        out = subprocess.run(["bash", "-c", f'{read_tag}\necho "$ref"'], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=30, check=True).stdout
        ref = out.strip()
        assert ref and "@" not in ref and ":" in ref, (entry, ref)  # an official tag
        assert f"FROM ${{{entry['base_arg']}}}" in (ROOT / entry["dockerfile"]).read_text()


def test_the_chart_job_pins_by_digest_and_pushes_an_oci_chart(workflow):
    job = workflow["jobs"]["chart"]
    runs = "\n".join(s.get("run", "") for s in job["steps"])
    assert "pin_chart_images.py charts/sluice/values.yaml" in runs
    assert 'helm package charts/sluice --version "$VERSION" --app-version "$VERSION"' in runs
    assert 'helm push "dist/sluice-$VERSION.tgz" "oci://$REGISTRY/charts"' in runs
    assert "imagetools inspect" in runs and "linux/amd64,linux/arm64" in runs
    download = steps_using(job, "actions/download-artifact")[0]["with"]
    assert download["pattern"] == "digest-*" and download["merge-multiple"] is True
    # the helm that renders the chart in tests/test_chart*.py
    version = subprocess.run([tool("helm"), "version", "--short"], capture_output=True,
                             text=True, timeout=60, check=True).stdout
    assert version.startswith(workflow["env"]["HELM_VERSION"] + "+")


def test_the_chart_names_the_images_the_workflow_publishes():
    """values.yaml's repositories are ghcr.io/<owner of the chart's home>/<workflow image>."""
    home = yaml.safe_load((CHART / "Chart.yaml").read_text())["home"]
    owner = re.fullmatch(r"https://github\.com/([^/]+)/[^/]+", home).group(1)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["operator"]["image"]["repository"] == f"ghcr.io/{owner}/sluice-operator"
    assert values["picker"]["image"]["repository"] == f"ghcr.io/{owner}/sluice-gateway"
    assert values["operator"]["engineImage"].startswith(f"ghcr.io/{owner}/sluice-engine:")
    for name, dockerfile in IMAGES.items():  # the build command each Dockerfile documents
        assert f"-t ghcr.io/{owner}/{name}:" in (ROOT / dockerfile).read_text()


def pinned_chart(tmp_path: Path) -> Path:
    chart = tmp_path / "sluice"
    shutil.copytree(CHART, chart)
    digests = tmp_path / "digests"
    digests.mkdir()
    for name, digest in DIGESTS.items():
        (digests / name).write_text(digest + "\n")
    assert pin_chart_images.main([str(chart / "values.yaml"), "--registry", "ghcr.io/acme",
                                  "--version", "1.2.3", "--digests", str(digests)]) == 0
    return chart


def test_pinning_changes_only_the_image_values_and_keeps_the_comments(tmp_path):
    before = (CHART / "values.yaml").read_text()
    after = (pinned_chart(tmp_path) / "values.yaml").read_text()
    values = yaml.safe_load(after)
    assert values["operator"]["image"] == {"repository": "ghcr.io/acme/sluice-operator",
                                           "tag": f"1.2.3@{DIGESTS['sluice-operator']}",
                                           "pullPolicy": "IfNotPresent"}
    assert values["picker"]["image"]["tag"] == f"1.2.3@{DIGESTS['sluice-gateway']}"
    assert values["operator"]["engineImage"] == \
        f"ghcr.io/acme/sluice-engine:1.2.3@{DIGESTS['sluice-engine']}"
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines()) if a != b]
    assert len(before.splitlines()) == len(after.splitlines()) and len(changed) == 5
    assert all(re.fullmatch(r"\s+(repository|tag|engineImage): \S.*", b) for _, b in changed)


def test_the_pinned_chart_lints_packages_and_renders_every_sluice_image_by_digest(
        tmp_path, kube_plane, kube_ns):
    chart = pinned_chart(tmp_path)
    helm = tool("helm")

    def run(*args: str) -> str:
        out = subprocess.run([helm, *args], capture_output=True, text=True, timeout=120,
                             check=False)
        assert out.returncode == 0, out.stderr
        return out.stdout

    run("lint", "--strict", str(chart))  # (values.schema.json accepts the pins)
    run("package", str(chart), "--version", "1.2.3", "--app-version", "1.2.3",
        "-d", str(tmp_path / "dist"))
    package = tmp_path / "dist" / "sluice-1.2.3.tgz"
    rendered = run("template", "sluice", str(package), "--namespace", "sluice")
    images = set(re.findall(r'(?:image: |--engine-image=)"?([^ "\n]+)', rendered))
    ours = {i for i in images if "/sluice-" in i}
    assert ours == {f"ghcr.io/acme/{name}:1.2.3@{DIGESTS[name]}" for name in IMAGES}
    assert 'app.kubernetes.io/version: "1.2.3"' in rendered
    # and a real API server takes the package's manifests (pinned references are valid)
    install_crds(kube_plane, *CHART_CRDS)
    manifests = run("template", "sluice", str(package), "--namespace", kube_ns)
    assert server_errors(kube_plane, [d for d in yaml.safe_load_all(manifests) if d]) == ""


def test_a_missing_key_or_a_bad_digest_is_refused(tmp_path):
    with pytest.raises(KeyError):
        pin_chart_images.set_scalar("operator:\n  image:\n    tag: x\n",
                                    ("operator", "engineImage"), "y")
    with pytest.raises(KeyError):  # a deeper key of the same name is not a direct child
        pin_chart_images.set_scalar("a:\n  b:\n    c: 1\n", ("a", "c"), "y")
    for name in IMAGES:
        (tmp_path / name).write_text("sha256:abc\n")
    with pytest.raises(SystemExit, match="not a sha256 digest"):
        pin_chart_images.read_digests(tmp_path)
