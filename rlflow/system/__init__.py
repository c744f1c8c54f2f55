"""The ground floor: process plumbing every other floor may use; it imports nothing of rlflow
(``tests/unit/test_layering.py``).

* :mod:`rlflow.system.ports`: free ports outside the kernel's ephemeral range, wildcard and
  advertised hosts.
* :mod:`rlflow.system.plugins`: the user's plugin modules, imported in every process, and the
  name -> object registries they fill.
* :mod:`rlflow.system.process_limits`: process groups, memory limits and exit texts of child
  processes.
* :mod:`rlflow.system.oom`: the out-of-memory killer's verdict on a child (cgroup counters).
* :mod:`rlflow.system.host_memory`: the malloc environment the launcher gives its programs.
"""
