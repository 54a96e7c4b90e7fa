"""Multi-node serving (#14): one EP domain over several machines on torch.distributed.

``rendezvous`` (TCPStore at ``--master_addr:--master_port``, config check, run facts),
``bridge`` (engine <-> a remote node's rings over a two-process gloo control group),
``launcher`` (one node's shm, children and supervision), ``serve`` (the ``serve`` entry when
``--nnodes`` > 1). Layer: above ``launcher`` (it reuses the single-node launcher's parts).
"""
