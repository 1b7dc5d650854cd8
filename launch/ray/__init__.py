"""`staleflow up --launcher ray`: the job's components as detached, named Ray actors.

Ray places and restarts the processes; StaleFlow's own HTTP contracts stay the data and control
plane. Each component (manager, parameter server, reward, trajectory server, rollout instances,
coordinator) is one actor running what ``staleflow serve component NAME`` runs: ``build_app`` +
an HTTP server on the node that hosts it. Trainer ranks are one actor each.

* **Placement.** Detached placement groups in a per-job namespace: ``control`` (every control
  service on CPU, one node), ``trainer`` (one bundle per trainer node, ranks split evenly, bundles
  sorted by node IP) and ``rollout`` (one bundle per instance, holding its GPUs; none for the sim
  engine). On a cluster as Ray starts it, roles go wherever there is room; nodes marked for a role
  (its custom resource or label) or a selector in the job's ``cluster:`` section narrow that.
  A plan the cluster cannot satisfy fails before anything starts, naming what is missing.
* **Endpoints** are planned on the node that serves them: a probe task in the component's bundle
  returns the node's IP and a free port from ``cluster.port_range``. The map is published in
  ``<state>/endpoints.json`` and in the ``endpoints`` registry actor, so any machine attached to the
  cluster finds the job by its namespace.
* **Faults.** A component that dies while the job starts is restarted like one that dies later
  (one whose start fails exits, so that Ray restarts it) and the start-up waits for it.
  Service and instance actors restart in place (``max_restarts``), re-binding their
  planned port; one that comes back on another node takes a new port there, updates the registry
  and, for an instance, re-registers with the coordinator (``PUT /v1/instances/{id}``). An instance
  whose engine died exits so Ray restarts it. Trainer ranks restart as a gang (NCCL cannot repair
  a communicator), resuming from the newest checkpoint and the step log.
* **Supervision.** The job's supervisor (``staleflow.launch.supervisor``, the same one a local
  run has) drives this launcher through ``staleflow.launch.launcher.Launcher``: it sees an actor's
  process die in Ray's actor table, waits for Ray's restart and records it (``summary.json``'s
  ``restarts``), kills for Ray to restart a service whose health probe keeps failing or an
  instance the coordinator declares failed, restarts the trainer gang, and stops the job when a
  component keeps failing (``supervision.max_restarts`` within ``restart_window_s``).
* **Token.** The run's bearer token is a constructor argument each actor puts into its own
  environment, never a ``runtime_env`` variable (Ray's dashboard shows those).

Ray is imported lazily: nothing here runs unless ``--launcher ray`` is asked for.

The package, by what each part does: ``common`` (names, the registry and cluster-wide actions the
CLI uses too), ``placement`` (the placement plan and its preflight, on the driver), ``actors``
(what runs on the nodes: components, trainer ranks, the registry) and ``job`` (``RayClusterJob``,
the launcher).
"""
