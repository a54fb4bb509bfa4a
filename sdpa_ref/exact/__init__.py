"""Error-free arithmetic for ``precision="reproducible"``: double-double element-wise arithmetic with its
own ``exp``, ``log`` and ``tanh`` (:mod:`.dd`) and exact matrix products on the BLAS (:mod:`.ozaki`)."""
