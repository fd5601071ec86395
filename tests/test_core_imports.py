"""core/ imports no torch, so the scheduler and KV-cache manager stay testable with no model."""

import subprocess
import sys


def test_core_imports_no_torch():
    code = ("import sys; import tokenmill.core.scheduler, tokenmill.core.kv_cache_manager; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
