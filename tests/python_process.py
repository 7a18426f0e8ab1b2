"""Python subprocesses of the tests: ``python -c SCRIPT ARGS`` as a user's process would start it."""

import os
import subprocess
import sys
import tempfile


def run_python(script: str, *args: str, env_drop=(), env_add=None, cwd=None, timeout=300):
    """``python -c script args`` -> CompletedProcess (text output, no check).

    It starts outside the checkout (``cwd`` default: the temp folder): there the checkout's ``mm3_compile/``
    sources, which lack the ``kernels``/``lowerings`` mapping of an install, would shadow a non-editable
    install (an unpacked sdist's tests). ``env_drop``: variables removed (``TRITON_INTERPRET`` for a GPU
    compile); ``env_add``: variables set.
    """
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env.update(env_add or {})
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        cwd=cwd or tempfile.gettempdir(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
