# SPDX-License-Identifier: MIT
"""ctypes bindings of libaoq (client/include/aoq/aoq.h).

The library is found, in this order, at:
  1. $AOQ_LIBRARY (a full path),
  2. aoq/_native/libaoq.so, the copy a wheel carries (pip install of the
     repository root builds and bundles it),
  3. the build trees of the source checkout this package sits in
     (<repo>/build/client/libaoq.so, then <repo>/build-*/client/libaoq.so),
  4. ctypes.util.find_library("aoq") (an installed libaoq).
"""
import ctypes
import ctypes.util
import errno as _errno
import glob
import os
import threading

c_void_p = ctypes.c_void_p
c_char_p = ctypes.c_char_p
c_int = ctypes.c_int
c_uint = ctypes.c_uint
c_uint32 = ctypes.c_uint32
c_uint64 = ctypes.c_uint64
c_double = ctypes.c_double
c_bool = ctypes.c_bool

# enum aoq_dtype
FP32, BF16, FP16 = 0, 1, 2
# enum aoq_optimizer
ADAMW, ADAM, SGD, LION = 0, 1, 2, 3
# enum aoq_precision
STATE_FP32, STATE_Q8, STATE_BF16, STATE_BF16_Q8, STATE_BF16_ALL = 0, 1, 2, 3, 4
STATE_Q4, STATE_BF16_Q4 = 5, 6
# push flags
PUSH_ACCUMULATE = 1 << 0
# enum aoq_state_kind (read_state / load_state `what`)
MASTER, EXP_AVG, EXP_AVG_SQ = 0, 1, 2

# AOQ_ABI_VERSION of the <aoq/aoq.h> these layouts copy; check_library()
# compares it and every struct's size with what the loaded library reports.
ABI_VERSION = 5


class _Sized(ctypes.Structure):
    """A public struct of <aoq/aoq.h>: its first field, `size`, is set to
    the struct's size; the positional arguments fill the fields after it."""

    def __init__(self, *args, **kw):
        super().__init__(ctypes.sizeof(type(self)), *args, **kw)


class Group(_Sized):
    _fields_ = [
        ("size", c_uint32),
        ("kind", c_int),
        ("lr", c_double),
        ("beta1", c_double),
        ("beta2", c_double),
        ("eps", c_double),
        ("weight_decay", c_double),
        ("momentum", c_double),
        ("dampening", c_double),
        ("nesterov", c_bool),
    ]


class Tensor(_Sized):
    _fields_ = [
        ("size", c_uint32),
        ("name", c_char_p),
        ("numel", c_uint64),
        ("param_dtype", c_int),
        ("grad_dtype", c_int),
        ("group", c_uint32),
        ("param", c_void_p),
        ("grad", c_void_p),
        ("init", c_void_p),
        ("init_dtype", c_int),
    ]


# struct aoq_options and struct aoq_step_result of <aoq/aoq.h>.
class Options(_Sized):
    _fields_ = [
        ("size", c_uint32),
        ("socket", c_char_p),
        ("job", c_char_p),
        ("rank", c_uint32),
        ("device", c_char_p),
        ("precision", c_int),
        ("window", c_uint64),
        ("seed", c_uint64),
        ("max_grad_norm", c_double),
        ("skip_nonfinite", c_bool),
        ("delayed_update", c_bool),
        ("cuda_stream", c_void_p),
        ("ze_context", c_void_p),
        ("ze_device", c_void_p),
        ("ze_queue", c_void_p),
        ("timeout_ms", c_uint32),
        ("lease_seconds", c_uint32),  # ABI 3
        ("local_world", c_uint32),    # ABI 4: replica group
        ("local_rank", c_uint32),
        ("master_bits", c_uint32),    # ABI 5
    ]


class StepResult(_Sized):
    _fields_ = [
        ("size", c_uint32),
        ("step", c_uint64),
        ("grad_sumsq", c_double),
        ("nonfinite", c_bool),
        ("skipped", c_bool),
        ("clip_scale", c_double),
        ("tensors_updated", c_uint64),
    ]


class DeviceStep(_Sized):
    """struct aoq_device_step (aoq_device_adam_q8: the GPU share's q8 step)."""
    _fields_ = [
        ("size", c_uint32),
        ("device", c_int),
        ("param", c_void_p),
        ("param_dtype", c_int),
        ("grad", c_void_p),
        ("grad_dtype", c_int),
        ("master", c_void_p),
        ("master_lo", c_void_p),
        ("m", c_void_p),
        ("v", c_void_p),
        ("m_scale", c_void_p),
        ("v_scale", c_void_p),
        ("n", c_uint64),
        ("lr", c_double),
        ("beta1", c_double),
        ("beta2", c_double),
        ("eps", c_double),
        ("weight_decay", c_double),
        ("decoupled", c_bool),
        ("step", c_uint64),
        ("seed", c_uint64),
        ("grad_scale", ctypes.c_float),
        ("max_blocks", c_uint32),     # a grid cap (0: none); libaoq takes the struct without it too
    ]


class AoqError(OSError):
    """A libaoq call failed: .errno is the (positive) errno value, .strerror
    libaoq's message (aoq_last_error(), including the daemon's Error text)."""


def _candidates():
    env = os.environ.get("AOQ_LIBRARY")
    if env:
        yield env
        return
    here = os.path.dirname(os.path.abspath(__file__))      # <repo>/client/python/aoq
    bundled = os.path.join(here, "_native", "libaoq.so")
    if os.path.exists(bundled):
        yield bundled
    repo = os.path.normpath(os.path.join(here, "..", "..", ".."))
    yield os.path.join(repo, "build", "client", "libaoq.so")
    for d in sorted(glob.glob(os.path.join(repo, "build-*", "client", "libaoq.so"))):
        yield d
    found = ctypes.util.find_library("aoq")
    if found:
        yield found


_lib = None
_lib_lock = threading.Lock()


def _declare(lib):
    opts, res = Options, StepResult
    P = c_void_p
    sigs = {
        "aoq_version": (c_char_p, []),
        "aoq_abi_version": (c_int, []),
        "aoq_struct_size": (ctypes.c_size_t, [c_char_p]),
        "aoq_last_error": (c_char_p, []),
        "aoq_dtype_name": (c_char_p, [c_int]),
        "aoq_connect": (c_int, [ctypes.POINTER(P), ctypes.POINTER(opts)]),
        "aoq_add_group": (c_int, [P, ctypes.POINTER(Group)]),
        "aoq_add_tensor": (c_int, [P, ctypes.POINTER(Tensor)]),
        "aoq_register": (c_int, [P]),
        "aoq_current_step": (c_uint64, [P]),
        "aoq_push_grad": (c_int, [P, c_uint32, c_uint, P]),
        "aoq_push_grad_ptr": (c_int, [P, c_uint32, P, c_uint, P]),
        "aoq_grad_copied": (c_int, [P, c_uint32]),
        "aoq_grad_pending": (c_int, [P, c_uint32]),
        "aoq_wait_param": (c_int, [P, c_uint32, P]),
        "aoq_sync_param": (c_int, [P, c_uint32]),
        "aoq_set_hyperparams": (c_int, [P, c_uint32, ctypes.POINTER(Group)]),
        "aoq_step_end": (c_int, [P]),
        "aoq_sync": (c_int, [P, ctypes.POINTER(res)]),
        "aoq_read_state": (c_int, [P, c_uint32, c_int, c_int, c_uint64, c_uint64, P]),
        "aoq_load_state": (c_int, [P, c_uint32, c_int, c_int, c_uint64, c_uint64, P]),
        "aoq_get_tensor_steps": (c_int, [P, c_uint32, c_uint32, ctypes.POINTER(c_uint64)]),
        "aoq_set_tensor_steps": (c_int, [P, c_uint32, c_uint32, ctypes.POINTER(c_uint64)]),
        "aoq_release_tensors": (c_int, [P, ctypes.POINTER(c_uint32), c_uint32, ctypes.POINTER(c_uint64)]),
        "aoq_flush": (c_int, [P]),
        "aoq_session_seed": (c_uint64, [P]),
        "aoq_resumed": (c_int, [P, ctypes.POINTER(c_uint64)]),
        "aoq_close": (None, [P]),
        "aoq_device_adam_q8": (c_int, [ctypes.POINTER(DeviceStep), P]),
    }
    for name, (restype, argtypes) in sigs.items():
        if name in _SINCE and not hasattr(lib, name):
            continue    # an older libaoq of this ABI: callers check hasattr
        f = getattr(lib, name)
        f.restype = restype
        f.argtypes = argtypes
    lib.Options = opts
    lib.StepResult = res


# Calls a libaoq of this ABI may lack (added since the ABI's first release).
_SINCE = frozenset(["aoq_release_tensors"])


def _check(lib):
    """Raises OSError(EPROTO) unless lib's ABI and struct sizes are the ones
    this module's layouts copy."""
    abi = lib.aoq_abi_version()
    bad = [] if abi == ABI_VERSION else ["ABI %d (this binding speaks %d)" % (abi, ABI_VERSION)]
    bad += _struct_size_mismatches(lib)
    if bad:
        raise OSError(_errno.EPROTO, "%s (libaoq %s) does not match the aoq package: %s"
                      % (getattr(lib, "path", "libaoq"), lib.aoq_version().decode(), "; ".join(bad)))


def check_library():
    """Loads libaoq and checks that it is the library this binding was written
    for (ABI version and the size of every public struct); returns its
    version string, the release and the build ("0.1.0+<git describe>").  load() does the same check: a library that fails it is
    never used."""
    return load().aoq_version().decode()


def load():
    """The loaded libaoq (a ctypes.CDLL with prototypes set)."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        tried = []
        for path in _candidates():
            if os.path.sep in path and not os.path.exists(path):
                tried.append(path + " (missing)")
                continue
            try:
                lib = ctypes.CDLL(path)
                _declare(lib)
            except (OSError, AttributeError) as e:
                tried.append("%s (%s)" % (path, e))
                continue
            check_library_version(lib, path)
            lib.path = path
            _check(lib)
            _lib = lib
            return lib
        raise OSError(_errno.ENOENT, "libaoq.so not found; set AOQ_LIBRARY to its full path. Tried: "
                      + ("; ".join(tried) or "nothing"))


def last_error():
    msg = load().aoq_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


def check(r, what=""):
    """Raises AoqError for a negative return value; returns r otherwise."""
    if r is not None and r < 0:
        msg = last_error() or os.strerror(-r)
        raise AoqError(-r, ("%s: %s" % (what, msg)) if what else msg)
    return r


# ---- Is the loaded libaoq the one this package was written for? ------------
# PACKAGE_VERSION is the libaoq version this package speaks (aoq.__version__,
# the meson project's version; a wheel bundles the libaoq built from the same
# tree).  load() calls check_library_version() on the library it found: a
# libaoq that exports aoq_version() and reports another version is refused
# with an ImportError; one without aoq_version() predates the versioned API
# and is used as it is.
PACKAGE_VERSION = "0.1.0"

# STRUCT-SIZE CHECK: the one place that compares the ctypes layouts above with
# the library's own sizes (aoq_struct_size(name), where the library has it).
_STRUCTS = {"aoq_options": Options, "aoq_group": Group, "aoq_tensor": Tensor, "aoq_step_result": StepResult,
            "aoq_device_step": DeviceStep}


def _struct_size_mismatches(lib):
    f = getattr(lib, "aoq_struct_size", None)
    if f is None:
        return []
    f.restype, f.argtypes = ctypes.c_size_t, [c_char_p]
    bad = []
    for cname, cls in _STRUCTS.items():
        n, here = f(cname.encode()), ctypes.sizeof(cls)
        if n != here:
            bad.append("struct %s is %d bytes there, %d in this package" % (cname, n, here))
    return bad


def check_library_version(lib, path, expected=None):
    """Raises ImportError unless lib (loaded from path) is the libaoq this
    package speaks: aoq_version()'s release (before a '+' and the build)
    equal to `expected` (PACKAGE_VERSION) and the public structs' sizes equal
    to this module's layouts.  Returns aoq_version(): release and build."""
    expected = expected or PACKAGE_VERSION
    bad = []
    f = getattr(lib, "aoq_version", None)
    version = None
    if f is not None:
        f.restype, f.argtypes = c_char_p, []
        raw = f()
        version = raw.decode("utf-8", "replace") if raw else "?"
        if version.split("+", 1)[0] != expected:
            bad.append("libaoq %s, this package expects %s" % (version, expected))
    bad += _struct_size_mismatches(lib)
    if bad:
        raise ImportError("aoq: the libaoq at %s does not match this aoq package (%s): %s. Reinstall the package "
                          "(pip install of the repository root builds a matching libaoq), rebuild the checkout, "
                          "or point AOQ_LIBRARY at a matching libaoq.so" % (path, PACKAGE_VERSION, "; ".join(bad)))
    return version
