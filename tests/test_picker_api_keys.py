"""Client API keys at the picker: 401 in the OpenAI shape, keys from a folder (a mounted
Secret) reloaded without restart, the key never forwarded, its name in the access log."""

import os
import time

import openai
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from fake_engine import ThreadServer as Server
from fake_engine import fake_engine
from picker_harness import ExtProcClient, Front, PickerThread, headers, static_core, wait_for

from sluice.gateway.core import CoreConfig, RoutingCore
from sluice.gateway.discovery.static import Endpoint, StaticDiscovery
from sluice.gateway.server.api_keys import ApiKeys
from sluice.gateway.server.messages import KEY_NAME, LB_NAMESPACE


def test_keys_from_a_folder_are_reloaded_when_it_changes(tmp_path):
    (tmp_path / "team-a").write_text("sk-aaaa\n")
    (tmp_path / "..data").mkdir()  # (a mounted Secret's own entries are skipped)
    keys = ApiKeys("sk-fixed", str(tmp_path), reload_s=0.01)
    assert not keys.open and len(keys) == 2
    assert keys.name_of("Bearer sk-aaaa") == "team-a"
    assert keys.name_of("bearer sk-fixed") == "default"
    for bad in (None, "", "sk-aaaa", "Bearer sk-aaab", "Basic sk-aaaa", "Bearer "):
        assert keys.name_of(bad) is None
    (tmp_path / "team-a").unlink()  # revoked
    (tmp_path / "team-b").write_text("sk-bbbb")
    keys.reload()
    assert keys.name_of("Bearer sk-aaaa") is None and keys.name_of("Bearer sk-bbbb") == "team-b"
    assert ApiKeys().open
    (tmp_path / "broken").write_bytes(b"\xff\xfe not text")  # skipped, the rest still read
    (tmp_path / "team-c").write_text("sk-cccc")
    keys.reload()
    assert keys.name_of("Bearer sk-cccc") == "team-c"
    (tmp_path / "broken").unlink()
    (tmp_path / "team-c").unlink()
    (tmp_path / "team-b").unlink()
    keys.reload()
    assert not ApiKeys(None, str(tmp_path)).open  # an empty folder refuses everyone


@pytest.fixture
def keyed_front(tmp_path):
    (tmp_path / "team-a").write_text("sk-aaaa")
    with Server(fake_engine("ok", {})) as up:
        gw = static_core([up.port])
        keys = ApiKeys(None, str(tmp_path), reload_s=0.05)
        with Front(gw, keys=keys) as front:
            wait_for(lambda: len(gw.registry.active()) == 1)
            yield front, tmp_path


def test_through_envoy_a_wrong_missing_or_revoked_key_gets_401(keyed_front):
    front, folder = keyed_front
    good = openai.OpenAI(base_url=front.url + "/v1", api_key="sk-aaaa", max_retries=0)
    assert good.completions.create(model="m", prompt="hi", max_tokens=1).choices
    for key in ("sk-wrong", ""):
        bad = openai.OpenAI(base_url=front.url + "/v1", api_key=key or "x", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as err:
            bad.completions.create(model="m", prompt="hi", max_tokens=1)
        assert err.value.status_code == 401 and err.value.body["code"] == 401
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    os.remove(folder / "team-a")  # revoked: refused once the folder is read again
    deadline = time.time() + 10
    while True:
        try:
            good.completions.create(model="m", prompt="hi", max_tokens=1)
        except openai.AuthenticationError:
            break
        assert time.time() < deadline
        time.sleep(0.05)
    # the key's name, never the key, reaches the access log and the metrics
    log = front.envoy.access_log()
    assert "key=team-a" in log and "sk-aaaa" not in log
    counted = front.picker.call(
        lambda: front.gw.metrics.requests.labels("team-a")._value.get())
    assert counted >= 1


def test_the_engine_never_sees_the_clients_key():
    seen = {}
    with Server(fake_engine("ok", seen)) as up:
        gw = static_core([up.port])
        with PickerThread(gw, keys=ApiKeys("sk-right")) as picker:
            client = ExtProcClient(picker.port)
            wait_for(lambda: len(gw.registry.active()) == 1)
            (first,) = client.exchange(pb.ProcessingRequest(request_headers=headers(
                "POST", "/v1/completions", authorization="Bearer sk-right")))
            removed = first.request_headers.response.header_mutation.remove_headers
            assert "authorization" in removed
            meta = first.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[KEY_NAME]
            assert meta.string_value == "default"
            (refused,) = client.exchange(pb.ProcessingRequest(request_headers=headers(
                "POST", "/v1/completions", authorization="Bearer sk-wrong")))
            assert refused.immediate_response.status.code == 401
            (health,) = client.exchange(pb.ProcessingRequest(  # probes carry no key
                request_headers=headers("GET", "/health", end_of_stream=True)))
            assert health.immediate_response.status.code == 200
            client.close()


@pytest.mark.parametrize("keyed", [True, False])
def test_through_envoy_the_engine_gets_its_own_key_or_the_open_gateways_header(keyed):
    """Body first (no headers message), the picker's header changes still reach the engine:
    a gateway key is removed and the engines' own key set; an open gateway passes the
    client's Authorization on (for engines that check their own key)."""
    seen = {}
    with Server(fake_engine("ok", seen)) as up:
        ep = Endpoint(pod=f"127.0.0.1:{up.port}", url=up.url, model="m", pool="m")
        gw = RoutingCore(CoreConfig(routing="round_robin",
                                    engine_api_key="sk-engine" if keyed else None),
                         StaticDiscovery([ep]))
        with Front(gw, keys=ApiKeys("sk-client") if keyed else None) as front:
            wait_for(lambda: len(gw.registry.active()) == 1)
            client = openai.OpenAI(base_url=front.url + "/v1", api_key="sk-client",
                                   max_retries=0)
            assert client.completions.create(model="m", prompt="hi", max_tokens=1).choices
            assert seen["headers"]["authorization"] == (
                "Bearer sk-engine" if keyed else "Bearer sk-client")
            assert seen["headers"]["x-gateway-destination-endpoint"] == ep.pod
