"""``python -m llmc.compiler.selfcheck_worker JOB_DIR``: run one build's architecture self-check.

The build (compiler/build/self_check.py, ``PendingSelfCheck``) pickles its checkpoint index and plan into
``JOB_DIR/in.pkl`` and goes on tracing; this process answers in ``JOB_DIR/out.pkl`` with
``("ok", SelfCheckResult)`` or ``("refused", message)``.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path


def main(job: Path) -> int:
    from llmc.compiler.build import self_check
    from llmc.compiler.build.driver import build

    ckpt, plan = pickle.loads((job / "in.pkl").read_bytes())
    answer = self_check.child(ckpt, plan, build)
    tmp = job / "out.pkl.tmp"
    tmp.write_bytes(pickle.dumps(answer))
    tmp.replace(job / "out.pkl")  # whole or absent: the build never reads half an answer
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
