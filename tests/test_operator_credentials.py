"""The ServiceAccount token is re-read when it rotates: by our client on a 401 (and every
minute), by kopf's through its login handler, which kopf calls again after a 401."""

from __future__ import annotations

import asyncio
import json
import pathlib

import httpx
import kopf
import yaml
from k8s_controllers import controllers
from k8s_harness import cluster, connection, eventually, operator

from sluice.operator import kube
from sluice.operator.credentials import Login, TokenAuth, TokenFile

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU_POOL = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())
NS, NAME = "default", "smollm2"


def test_token_file_is_cached_for_max_age_then_read_again(tmp_path):
    path, now = tmp_path / "token", [0.0]
    path.write_text("a\n")
    token = TokenFile(path, max_age_s=60, clock=lambda: now[0])
    assert token.current() == "a"
    path.write_text("b\n")
    now[0] = 59.0
    assert token.current() == "a"  # cached
    now[0] = 60.0
    assert token.current() == "b" and token.reloads == 2


def test_a_401_rereads_the_token_and_repeats_the_request_once(tmp_path):
    path = tmp_path / "token"
    path.write_text("old")
    seen: list[str] = []

    def server(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["Authorization"])
        ok = request.headers["Authorization"] == "Bearer new"
        return httpx.Response(200 if ok else 401, json={})

    async def scenario():
        token = TokenFile(path, max_age_s=3600)
        async with httpx.AsyncClient(transport=httpx.MockTransport(server),
                                     auth=TokenAuth(token)) as http:
            assert (await http.get("http://api/x")).status_code == 401  # file unchanged
            path.write_text("new")  # the kubelet rotated it
            assert (await http.get("http://api/x")).status_code == 200
    asyncio.run(scenario())
    # 1st: refused, the file unchanged, not repeated; 2nd: refused, re-read, repeated
    assert seen == ["Bearer old", "Bearer old", "Bearer new"]


def test_login_reads_the_file_each_time(tmp_path):
    path = tmp_path / "token"
    path.write_text("a")
    login = Login(kopf.ConnectionInfo(server="https://k8s", ca_path="/ca"), TokenFile(path))
    assert login.connection().token == "a"
    path.write_text("b")
    info = login.connection()
    assert info.token == "b" and info.ca_path == "/ca" and info.server == "https://k8s"
    assert Login(kopf.ConnectionInfo(server="https://k8s", token="t")).http_auth() is None


def test_token_rotation_keeps_both_clients_working(tmp_path):
    """The API server stops accepting the old token (it expired after the kubelet wrote a
    new one). The next change is still handled: our client and kopf's both switch."""
    path = tmp_path / "token"
    path.write_text("token-a\n")

    async def scenario():
        async with cluster() as (api, server):
            api.tokens = {"token-a"}
            login = Login(connection(server), TokenFile(path, max_age_s=3600))  # 401s only
            client = kube.KubeClient.from_connection(
                connection(server), auth=TokenAuth(TokenFile(path, max_age_s=0)))
            client._http.headers["User-Agent"] = "test-client"
            async with operator(server, login=login), controllers(api):
                await client.create(kube.POOLS, NS, CPU_POOL)
                dep = lambda: api.store.get(api.kind("deployments"), NS, "smollm2-serve")
                await eventually(dep, 3, "Deployment")
                path.write_text("token-b\n")
                api.tokens = {"token-b"}
                await client.patch(kube.POOLS, NS, NAME, {"spec": {"replicas": 2}})
                await eventually(lambda: dep()["spec"]["replicas"] == 2, 5, "our client")

                def handled_by_kopf():  # kopf's own patch of the pool, after its re-login
                    pool = api.store.get(api.kind("inferencepools"), NS, NAME)
                    last = pool["metadata"]["annotations"]["sluice.dev/last-handled-configuration"]
                    return json.loads(last)["spec"]["replicas"] == 2
                await eventually(handled_by_kopf, 5, "kopf's client")
            await client.close()
        return api.token_log

    log = asyncio.run(asyncio.wait_for(scenario(), 60))
    agents = {agent.split("/")[0] for agent, token in log if token == "token-b"}
    assert {"kopf", kube.USER_AGENT.split("/")[0]} <= agents, agents
