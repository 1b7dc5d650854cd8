FROM python:3.11-slim
# optional extras to install, comma-separated: postgres (the default), ray, vllm, train, ...
# e.g. docker build --build-arg EXTRAS=ray,vllm,train,postgres -t staleflow:0.1.0 .
ARG EXTRAS=postgres
WORKDIR /app
COPY . .
RUN pip install --no-cache-dir ".[${EXTRAS}]"
EXPOSE 8321
CMD ["staleflow", "serve", "manager", "--host", "0.0.0.0"]
