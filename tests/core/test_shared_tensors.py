"""Tensor bytes through /dev/shm segments (core/shared_tensors.py) and the codec's reading of them:
the reader gets the writer's bytes and unlinks the name; names, owners, sizes and file kinds other
than a relay segment's are refused naming the field; nothing is left behind."""

from __future__ import annotations

import os

import numpy as np
import pytest

from stagemesh.core import codec, shared_tensors
from stagemesh.core.errors import InvalidArgument
from stagemesh.v1 import tensor_pb2


def _path(name: str):
    return shared_tensors.SHM_DIR / name


@pytest.fixture
def array() -> np.ndarray:
    return np.arange(3 * 5 * 7, dtype=np.float32).reshape(3, 5, 7)


def _exported(array: np.ndarray) -> tensor_pb2.Tensor:
    name = shared_tensors.export(memoryview(array).cast("B"), os.getpid())
    return tensor_pb2.Tensor(dtype="float32", shape=list(array.shape), shm_name=name)


def test_the_reader_gets_the_bytes_and_unlinks_the_name(array):
    message = _exported(array)
    assert shared_tensors.relay_name(1) != shared_tensors.relay_name(1)  # unguessable
    assert _path(message.shm_name).stat().st_mode & 0o777 == 0o600
    read = codec.to_array(message, "inputs[x]")
    np.testing.assert_array_equal(read, array)
    assert not _path(message.shm_name).exists()
    read[0, 0, 0] = -1  # a private mapping: the reader may write to it
    with pytest.raises(InvalidArgument, match=r"inputs\[x\]\.shm_name.*no segment"):
        codec.to_array(message, "inputs[x]")  # read once


def test_materialized_puts_the_bytes_in_the_message(array):
    message = _exported(array)
    inline = codec.materialized(message, "image")
    assert not inline.shm_name and inline.data == array.tobytes() and list(inline.shape) == list(array.shape)
    assert not _path(message.shm_name).exists()
    plain = tensor_pb2.Tensor(dtype="uint8", shape=[2], data=b"ab")
    assert codec.materialized(plain) is plain


def test_a_segment_of_another_size_is_refused_and_kept_for_its_owner(array):
    message = _exported(array)
    message.shape[:] = [3, 5, 6]
    try:
        with pytest.raises(InvalidArgument, match=r"holds 420 bytes; dtype and shape need 360"):
            codec.payload(message, "inputs[x]")
    finally:
        shared_tensors.discard([message])
    assert not _path(message.shm_name).exists()


@pytest.mark.parametrize("name", ["../../etc/passwd", "stagemesh-1-0-" + "0" * 32, "stagemesh-1-relay-xyz", ""])
def test_names_not_of_a_relay_segment_are_refused(name):
    message = tensor_pb2.Tensor(dtype="uint8", shape=[4], shm_name=name or "x")
    with pytest.raises(InvalidArgument, match=r"image\.shm_name.*is not a stagemesh relay segment"):
        codec.payload(message, "image")


def test_links_and_fifos_under_a_relay_name_are_refused_without_blocking(tmp_path):
    target = tmp_path / "secret"
    target.write_bytes(b"1234")
    link, fifo = shared_tensors.relay_name(os.getpid()), shared_tensors.relay_name(os.getpid())
    os.symlink(target, _path(link))
    os.mkfifo(_path(fifo), 0o600)
    try:
        for name, why in ((link, "cannot be read"), (fifo, "is not a segment of this user")):
            message = tensor_pb2.Tensor(dtype="uint8", shape=[4], shm_name=name)
            with pytest.raises(InvalidArgument, match=why):
                codec.payload(message, "image")
    finally:
        _path(link).unlink(missing_ok=True)
        _path(fifo).unlink(missing_ok=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_segment_of_another_user_is_refused(array):
    message = _exported(array)
    try:
        os.chown(_path(message.shm_name), 65534, 65534)
        with pytest.raises(InvalidArgument, match="is not a segment of this user"):
            codec.payload(message, "image")
    finally:
        _path(message.shm_name).unlink(missing_ok=True)


def test_data_and_a_segment_together_are_refused():
    message = tensor_pb2.Tensor(dtype="uint8", shape=[2], data=b"ab", shm_name=shared_tensors.relay_name(1))
    with pytest.raises(InvalidArgument, match=r"image\.data.*set together with shm_name"):
        codec.checked_shape(message, "image")


def test_a_segment_never_joins_pieces(array):
    message = _exported(array)
    try:
        with pytest.raises(InvalidArgument, match="comes whole"):
            codec.join_rows(message, tensor_pb2.Tensor(dtype="float32", shape=[1, 5, 7], data=bytes(140)))
    finally:
        shared_tensors.discard([message])


def test_discard_unlinks_relay_segments_only(array, tmp_path):
    message = _exported(array)
    plain = tensor_pb2.Tensor(dtype="uint8", shape=[2], data=b"ab")
    shared_tensors.discard([message, plain, message])  # twice: the second finds it gone
    assert not _path(message.shm_name).exists()


@pytest.mark.parametrize(
    ("peer", "local"),
    [
        ("ipv4:127.0.0.1:51634", True),
        ("ipv4:127.0.1.1:80", True),
        ("unix:", True),
        ("unix:/tmp/stage.sock", True),
        ("ipv6:[::1]:5000", True),
        ("ipv6:[::ffff:127.0.0.1]:5000", True),
        ("ipv4:10.0.0.7:51634", False),
        ("ipv6:[2001:db8::1]:5000", False),
        ("ipv4:1127.0.0.1:1", False),
        ("", False),
    ],
)
def test_only_a_caller_on_this_host_gets_segments(peer, local):
    assert shared_tensors.local_peer(peer) is local
