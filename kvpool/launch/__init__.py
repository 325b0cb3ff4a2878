"""Starting kvpool's services as child processes: ``cluster.Cluster`` (the one launcher API, used by
``kvpool up``, ``kvpool verify``, the demo, tests and benchmarks), its configuration (``config``), each
service's command line (``service_argv``), where a service runs (``placement``: loopback or its own network
namespace) and the HA control plane (``ha_cluster``: etcd members and the masters' election flags)."""
