"""Sandbox attacks on the network: reaching the host's loopback TCP and UDP servers, its abstract and
file unix sockets, raw and packet sockets, and its interfaces and routes. Each test asserts on the
host side that its server received nothing.

These tests talk only to servers they start on the host's 127.0.0.1 (or abstract/unix sockets);
nothing is ever sent beyond this machine. Shared helpers: tests/rl/sandbox_attack_helpers.py;
fixtures: tests/rl/conftest.py.
"""

import contextlib
import secrets
import socket
import time

import pytest

from sandbox_attack_helpers import _run  # loaded by tests/rl/conftest.py


@contextlib.contextmanager
def _listening(family, address):
  """A non-blocking stream server of the host on `address`, closed on exit."""
  server = socket.socket(family, socket.SOCK_STREAM)
  try:
    server.bind(address)
    server.listen(8)
    server.setblocking(False)
    yield server
  finally:
    server.close()


def test_connecting_to_a_host_loopback_tcp_server_fails(box):
  with _listening(socket.AF_INET, ("127.0.0.1", 0)) as server:
    port = server.getsockname()[1]
    result = _run(box, f"""
        import socket
        try:
          socket.create_connection(("127.0.0.1", {port}), timeout=1).sendall(b"exfiltrated")
          print("connected")
        except OSError as error:
          print(type(error).__name__)
        """)
    assert result.stdout == b"ConnectionRefusedError\n"
    with pytest.raises(BlockingIOError):
      server.accept()  # the host server received no connection


def test_sending_to_a_host_loopback_udp_server_reaches_nothing(box):
  server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
  server.bind(("127.0.0.1", 0))
  server.setblocking(False)
  port = server.getsockname()[1]
  try:
    result = _run(box, f"""
        import socket
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for _ in range(20):
          s.sendto(b"exfiltrated", ("127.0.0.1", {port}))
        print("sent")
        """)
    assert b"sent" in result.stdout or result.exit_code is not None
    time.sleep(0.1)
    with pytest.raises(BlockingIOError):
      server.recv(100)
  finally:
    server.close()


def test_abstract_unix_socket_of_the_host_is_unreachable(box):
  name = f"\0meshrl-test-{secrets.token_hex(8)}"
  with _listening(socket.AF_UNIX, name) as server:
    result = _run(box, f"""
        import socket
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
          s.connect({name!r})
          print("connected")
        except OSError as error:
          print(type(error).__name__)
        """)
    assert result.stdout == b"ConnectionRefusedError\n"
    with pytest.raises(BlockingIOError):
      server.accept()


def test_unix_socket_file_of_the_host_is_unreachable(box, tmp_path):
  path = str(tmp_path / "host.sock")
  with _listening(socket.AF_UNIX, path) as server:
    result = _run(box, f"""
        import socket
        try:
          socket.socket(socket.AF_UNIX).connect({path!r})
          print("connected")
        except OSError as error:
          print(type(error).__name__)
        """)
    assert result.stdout == b"FileNotFoundError\n"
    with pytest.raises(BlockingIOError):
      server.accept()


def test_only_a_private_loopback_interface_and_no_routes(box):
  result = _run(box, """
      import socket
      print(socket.if_nameindex())
      print(len(open('/proc/net/route').read().splitlines()))
      for family, kind in ((socket.AF_PACKET, socket.SOCK_RAW), (socket.AF_INET, socket.SOCK_RAW)):
        try:
          socket.socket(family, kind, 0 if family == socket.AF_PACKET else socket.IPPROTO_ICMP)
          print("raw socket")
        except OSError as error:
          print(type(error).__name__)
      """)
  assert result.stdout_text == "[(1, 'lo')]\n1\nPermissionError\nPermissionError\n"
  assert len(socket.if_nameindex()) >= 1  # the host's interfaces are untouched
