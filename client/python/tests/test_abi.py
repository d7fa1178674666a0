# SPDX-License-Identifier: MIT
"""The binding checks the library before using it: the built libaoq passes
(ABI version and every struct's size match the ctypes layouts), and a
layout that differs from the library's is refused."""
import ctypes
import errno
import sys

from aoq import _lib


def main():
    version = _lib.check_library()
    lib = _lib.load()
    assert version == lib.aoq_version().decode(), version
    for name, cls in _lib._STRUCTS.items():
        assert lib.aoq_struct_size(name.encode()) == ctypes.sizeof(cls), name
    # The size field is filled in by the constructor, positional arguments
    # go to the fields after it.
    g = _lib.Group(_lib.ADAM, 0.5)
    assert g.size == ctypes.sizeof(_lib.Group) and g.kind == _lib.ADAM and g.lr == 0.5

    class Shorter(_lib._Sized):  # a layout missing a field
        _fields_ = _lib.Group._fields_[:-1]

    saved = dict(_lib._STRUCTS)
    try:
        _lib._STRUCTS["aoq_group"] = Shorter
        try:
            _lib._check(lib)
        except OSError as e:
            assert e.errno == errno.EPROTO and "aoq_group" in str(e), e
        else:
            raise AssertionError("a wrong layout passed the check")
        _lib._STRUCTS.update(saved)
        real = _lib.ABI_VERSION
        _lib.ABI_VERSION = real + 1
        try:
            _lib._check(lib)
        except OSError as e:
            assert "ABI" in str(e), e
        else:
            raise AssertionError("another ABI passed the check")
        finally:
            _lib.ABI_VERSION = real
    finally:
        _lib._STRUCTS.clear()
        _lib._STRUCTS.update(saved)
    print("ok: libaoq %s, ABI %d" % (version, lib.aoq_abi_version()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
