FROM python:3.11-slim
WORKDIR /app
COPY . .
RUN pip install --no-cache-dir .
EXPOSE 8321
CMD ["staleflow", "serve", "manager", "--host", "0.0.0.0"]
