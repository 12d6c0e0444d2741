"""meshrl.rl.sandbox: run untrusted programs (model-written code, shell commands) in isolation.

`Sandbox(Limits(...)).run(argv or code, files=..., stdin=...) -> SandboxResult` runs one program in
a fresh bubblewrap sandbox (bwrap.py: namespaces, read-only runtime, private bounded /work) under
rlimits and a wall clock enforced by a supervisor at PID 1 (launcher.py). `SandboxPool` runs many
at once on a bounded worker pool and never raises for a run that fails. Where bubblewrap cannot run,
`SandboxUnavailable` says why and how to install it; nothing ever runs unisolated.

`Session` (session.py) is one sandbox that lives across an episode's turns: a shell whose working
directory, variables and background processes persist, commands with their own timeouts, checks
whose verdict nothing inside can forge; `SessionPool` keeps sessions warm.
"""

from meshrl.rl.sandbox.bwrap import Runtime, SandboxUnavailable, check_bwrap
from meshrl.rl.sandbox.limits import Limits
from meshrl.rl.sandbox.pool import PoolStats, Request, SandboxPool
from meshrl.rl.sandbox.result import SandboxResult
from meshrl.rl.sandbox.runner import Sandbox
from meshrl.rl.sandbox.session import CommandResult, Session, SessionSpec, SessionStartError
from meshrl.rl.sandbox.session_pool import PoolSet, SessionPool
