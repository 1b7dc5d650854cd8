"""The composition root: launches a whole job (``job``), injects faults into one (``faults``) and keeps
warm standby processes (``standby``). The only place besides the CLI that imports both the services
and the coordinator."""
