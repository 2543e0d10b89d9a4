"""The Containerfile (the image `render k8s --image` names) agrees with what it is built for: its
base image is the engine version the shipped profiles pin, it copies the wheel `pip wheel` names,
and `python3`, which it installs molctl into, is what the rendered pods run for both containers.
The build itself cannot run here (no container engine): the Containerfile's header says so."""

from __future__ import annotations

import fnmatch
import re

import yaml

import molctl
from molctl.profiles import load_profile, profile_dirs
from tests.helpers import ROOT

CONTAINERFILE = (ROOT / "Containerfile").read_text()


def test_the_base_image_is_the_vllm_the_profiles_pin():
    (tag,) = re.findall(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v(\S+)$", CONTAINERFILE, re.MULTILINE)
    pins = {name: load_profile(name, profile_dirs()).engine.version for name in ("venti", "tall")}
    assert pins == {"venti": f"=={tag}", "tall": f"=={tag}"}


def test_it_copies_the_wheel_pip_builds():
    (source,) = re.findall(r"^COPY (\S+) /tmp/wheels/$", CONTAINERFILE, re.MULTILINE)
    assert fnmatch.fnmatch(f"dist/molctl-{molctl.__version__}-py3-none-any.whl", source)


def test_the_rendered_pods_run_python3_for_engine_and_proxy(molctl):
    r = molctl("render", "k8s", "venti", "--image", "registry.internal/molctl-vllm:0.24.0", "--allow-unauthenticated")
    (sts,) = [d for d in yaml.safe_load_all(r.stdout) if d and d["kind"] == "StatefulSet"]
    args = {c["name"]: c["args"][:3] for c in sts["spec"]["template"]["spec"]["containers"]}
    assert args == {
        "engine": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
        "proxy": ["python3", "-m", "molctl"],
    }
