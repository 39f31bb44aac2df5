import time
def work():
    t=time.process_time(); s=0
    for i in range(20_000_000): s+=i
    return time.process_time()-t
print(round(work(),3))
