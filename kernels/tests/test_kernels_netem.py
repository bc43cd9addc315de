"""Emulated nodes (plait.kernels.benchmarks.netem): names, rates, counters; as root, real namespaces."""

import json
import socket
import subprocess
import sys
import time

import pytest

from plait.kernels.benchmarks import netem


def test_rate_bits_reads_tc_rates_and_refuses_others():
    assert netem.rate_bits("1gbit") == 10**9
    assert netem.rate_bits("100mbit") == 10**8
    assert netem.rate_bits("2.5mbit") == 2_500_000
    for bad in ("1gbps", "fast", "mbit"):
        with pytest.raises(ValueError, match="as tc does"):
            netem.rate_bits(bad)


def test_parse_link_stats_reads_ip_json_and_names_bad_text():
    entry = {"ifname": "x", "stats64": {"tx": {"bytes": 1234, "packets": 3}, "rx": {"bytes": 99, "packets": 1}}}
    assert netem.parse_link_stats(json.dumps([entry])) == (1234, 99)
    legacy = {"ifname": "x", "stats": {"tx": {"bytes": 5}, "rx": {"bytes": 6}}}
    assert netem.parse_link_stats(json.dumps([legacy])) == (5, 6)
    for bad in ("", "[]", json.dumps([{"ifname": "x"}]), "Device does not exist"):
        with pytest.raises(ValueError, match="ip -s -j link"):
            netem.parse_link_stats(bad)


def test_interface_tx_bytes_reads_sysfs(tmp_path):
    stats = tmp_path / "veth0" / "statistics"
    stats.mkdir(parents=True)
    (stats / "tx_bytes").write_text("4096\n")
    assert netem.interface_tx_bytes("veth0", sys_root=tmp_path) == 4096
    with pytest.raises(FileNotFoundError):
        netem.interface_tx_bytes("absent", sys_root=tmp_path)


def test_plan_two_nodes_is_one_pair_more_use_a_switch():
    two = netem.plan(2, "plt12345", 30)
    assert two.namespaces == ("plt12345n0", "plt12345n1")
    assert two.addresses == ("10.77.30.1", "10.77.30.2")
    assert two.switch_namespace is None and two.switch_devices == ()
    three = netem.plan(3, "plt1", 40)
    assert three.switch_namespace == "plt1sw" and len(three.switch_devices) == 3
    assert three.addresses[-1] == "10.77.40.3"
    for nodes in (two, three):
        assert all(len(name) <= 15 for name in (*nodes.devices, *nodes.switch_devices))  # IFNAMSIZ - 1
        assert nodes.command(1, ["true"]) == ["ip", "netns", "exec", nodes.namespaces[1], "true"]
    with pytest.raises(ValueError, match="between 2 and 200"):
        netem.plan(1, "plt", 20)
    with pytest.raises(ValueError, match="longer than 9"):
        netem.plan(2, "plait-too-long", 20)


def test_unavailable_reason_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(netem.os, "geteuid", lambda: 1000)
    assert "not root" in netem.unavailable_reason()
    monkeypatch.setattr(netem.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netem.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    assert "'tc'" in netem.unavailable_reason()


def test_emulated_link_keeps_the_two_node_names():
    assert netem.Link is netem.Nodes  # the onebit-optim benchmark's name for it


@pytest.mark.skipif(netem.unavailable_reason() is not None, reason=f"{netem.unavailable_reason()}")
def test_emulated_nodes_carry_and_count_bytes_between_nodes_and_clean_up():
    payload = 2_000_000
    with netem.emulated_nodes(2, prefix="tst") as nodes:
        before = [nodes.tx_bytes(0), nodes.tx_bytes(1)]
        listen = (f"import socket;s=socket.socket();s.bind(('{nodes.addresses[1]}',5555));s.listen();"
                  "c,_=s.accept();n=0\nwhile (d:=c.recv(65536)): n+=len(d)\nprint(n)")
        server = subprocess.Popen(nodes.command(1, [sys.executable, "-c", listen]), stdout=subprocess.PIPE, text=True)
        client = (f"import socket,time\nfor _ in range(100):\n try: s=socket.create_connection(('{nodes.addresses[1]}',"
                  f"5555)); break\n except OSError: time.sleep(0.05)\ns.sendall(b'x'*{payload})")
        subprocess.run(nodes.command(0, [sys.executable, "-c", client]), check=True, timeout=60)
        assert server.communicate(timeout=60)[0].strip() == str(payload)
        sent, acked = nodes.tx_bytes(0) - before[0], nodes.tx_bytes(1) - before[1]
        # The sender's end carries the payload plus its TCP/IP headers (about 5% at MTU 1500). The
        # ACKs go the other way and their share depends on how often the receiver acks (every
        # segment under load, one CI run saw 10.4% in all), so they get a loose bound of their own.
        assert payload <= sent <= payload * 1.1
        assert 0 < acked <= payload * 0.1
        nodes.set_rate("1gbit")
        shown = subprocess.run(["tc", "-n", nodes.namespaces[0], "qdisc", "show", "dev", nodes.devices[0]],
                               capture_output=True, text=True).stdout
        assert "tbf" in shown
        nodes.set_rate(None)
        names = nodes.namespaces
    time.sleep(0.1)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)
    assert socket.gethostname()  # the root namespace is untouched
