# A vLLM install that cannot load on this machine (the most common volunteer complaint: a wheel built
# for another CUDA). tests/integration/test_doctor.py puts this folder first on PYTHONPATH.
raise ImportError("libcudart.so.12: cannot open shared object file: No such file or directory")
