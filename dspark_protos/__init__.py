"""dspark_protos: Python stubs for the dspark.v1 gRPC contracts (protos/dspark/v1/*.proto).

Generated modules (do not edit; regenerate with ``python scripts/gen_protos.py``)::

    from dspark_protos.dspark.v1 import types_pb2                   # every message and enum
    from dspark_protos.dspark.v1 import scheduler_service_pb2_grpc  # SchedulerServiceStub / Servicer
    from dspark_protos.dspark.v1 import verifier_service_pb2_grpc   # VerifierServiceStub / Servicer
    from dspark_protos.dspark.v1 import drafter_service_pb2_grpc    # DrafterServiceStub / Servicer

Hand-written: :mod:`dspark_protos.tensors` converts between ``types_pb2.Tensor`` and ``torch.Tensor``
(the one place such conversions live).
"""
